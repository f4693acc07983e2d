"""Periodic checkpoints and `--resume`: a run killed after a checkpoint and resumed writes the
same metrics and ends on the same weights as the run that was never stopped; a colocated run
exports its policy."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from furlong import cli
from furlong.errors import InputError
from furlong.models import build_preset
from furlong.rl import loop
from furlong.rl.config import load_config
from furlong.rl.loop import train
from furlong.rl.scale import ScaleOut

pytestmark = pytest.mark.usefixtures("one_thread", "short_reward")

# wall-clock metrics: the only ones a resumed run may write differently
TIMED = {"step_seconds", "rollout_tokens_per_s"}
TINY = [
    "model.name=tiny-qwen3",
    "task.reward=short_text",
    "task.eval_size=4",
    "task.eval_samples=1",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.max_tokens=4",
    "algo.learning_rate=1e-2",
    "run.steps=6",
    "run.eval_every=3",
    "run.progress=false",
]
PPO = [
    "algo.advantage=gae",
    "algo.objective=ppo",
    "algo.kl_coef=0.05",
    "critic.warmup_steps=1",
    "warmup.steps=2",
    "warmup.batch_size=4",
    "colocate.enabled=true",
]


def config(out: Path, *overrides: str):
    return load_config(None, [*TINY, f"run.out_dir={out}", *overrides])


def rows(out: Path) -> list[dict[str, float]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMED} for line in lines]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "policy" / "model.safetensors"))


def assert_same_run(straight: Path, resumed: Path) -> None:
    a, b = rows(straight), rows(resumed)
    assert [r["step"] for r in b] == list(range(7))
    assert a == b
    wa, wb = weights(straight), weights(resumed)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


class Killed(Exception):
    pass


def test_grpo_killed_after_a_checkpoint_resumes_bit_identically(tmp_path, monkeypatch) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(config(straight))

    calls = []
    metrics = loop._episode_metrics

    def crash_in_step_4(*args):
        calls.append(1)
        if len(calls) == 4:  # step 4 generated; its metrics line never gets written
            raise Killed
        return metrics(*args)

    monkeypatch.setattr(loop, "_episode_metrics", crash_in_step_4)
    with pytest.raises(Killed):
        train(config(resumed, "run.save_every=3"))
    monkeypatch.setattr(loop, "_episode_metrics", metrics)
    assert (resumed / "checkpoints" / "latest").read_text() == "step-000003"
    assert [r["step"] for r in rows(resumed)] == [0, 1, 2, 3]
    assert not (resumed / "policy").exists()

    summary = train(config(resumed, "run.save_every=3"), resume=resumed)
    assert_same_run(straight, resumed)
    assert summary.before["eval_greedy"] == rows(straight)[0]["eval_greedy"]
    step6 = resumed / "checkpoints" / "step-000006"
    assert (resumed / "checkpoints" / "latest").read_text() == step6.name
    assert sorted(p.name for p in step6.iterdir()) == [
        "actor",
        "config.toml",
        "rng.safetensors",
        "state.json",
    ]


def test_ppo_colocated_grows_its_steps_from_the_cli(tmp_path) -> None:
    """Critic, KL reference after a warm-up, colocation: 3 steps, then 3 more with --resume."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(config(straight, *PPO))

    train(config(resumed, *PPO, "run.steps=3", "run.save_every=3"))
    step3 = resumed / "checkpoints" / "step-000003"
    assert {"actor", "actor_critic", "reference"} <= {p.name for p in step3.iterdir()}
    warmup = (resumed / "warmup.jsonl").read_text()
    assert cli.main(["train", "--resume", str(resumed), "run.steps=6"]) == 0
    assert (resumed / "warmup.jsonl").read_text() == warmup  # no second warm-up
    assert_same_run(straight, resumed)


def test_lora_with_a_warm_up_resumes_bit_identically(tmp_path, monkeypatch) -> None:
    """The checkpoint holds the adapter with its optimizer and the warmed-up base it adapts;
    the resumed run loads that base instead of model.name and runs no second warm-up."""
    lora = ["model.lora_rank=4", "warmup.steps=2", "warmup.batch_size=4", "run.export_adapter=true"]
    lora += ["algo.kl_coef=0.05"]  # a KL reference too: the warmed-up base, as loaded back
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(config(straight, *lora))

    calls = []
    metrics = loop._episode_metrics

    def crash_in_step_5(*args):
        calls.append(1)
        if len(calls) == 5:
            raise Killed
        return metrics(*args)

    monkeypatch.setattr(loop, "_episode_metrics", crash_in_step_5)
    with pytest.raises(Killed):
        train(config(resumed, *lora, "run.save_every=2"))
    monkeypatch.setattr(loop, "_episode_metrics", metrics)
    step4 = resumed / "checkpoints" / "step-000004"
    assert {"actor", "base", "reference"} <= {p.name for p in step4.iterdir()}
    assert (step4 / "base" / "model.safetensors").is_file()
    warmup = (resumed / "warmup.jsonl").read_text()
    assert cli.main(["train", "--resume", str(resumed)]) == 0
    assert (resumed / "warmup.jsonl").read_text() == warmup
    assert_same_run(straight, resumed)
    for exported in ("policy_adapter/adapter_model.safetensors", "policy_base/model.safetensors"):
        a, b = load_file(str(straight / exported)), load_file(str(resumed / exported))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), exported


def test_resume_refuses_a_changed_config(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    train(config(out, "run.steps=1", "run.save_every=1", "run.export_hf=false"))
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(InputError, match="rollout.group_size"):
        train(config(out, "rollout.group_size=2"), resume=out)
    step1 = str(out / "checkpoints" / "step-000001")
    assert cli.main(["train", "--resume", step1, "run.steps=0"]) == 2
    assert "run.steps" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == before  # a refusal changes nothing
    with pytest.raises(InputError, match="no complete checkpoint|neither"):
        train(config(tmp_path / "empty"), resume=tmp_path / "empty")
    ranks = ScaleOut(trainer_ranks=2)  # not wired for trainer ranks or Ray: refused up front
    with pytest.raises(InputError, match="run.save_every"):
        train(config(tmp_path / "ranks", "run.save_every=1"), ranks)
    with pytest.raises(InputError, match="--resume"):
        train(config(out), ranks, resume=out)


def test_colocated_run_exports_its_trained_policy(tmp_path) -> None:
    """The default run.export_hf with colocation: the last publish leaves the trainer asleep,
    the export wakes it; the HF directory holds the final checkpoint's actor weights."""
    out = tmp_path / "run"
    summary = train(config(out, "colocate.enabled=true", "run.steps=2", "run.save_every=2"))
    assert summary.hf_dir == out / "policy"
    policy = AutoModelForCausalLM.from_pretrained(summary.hf_dir)
    trained = load_file(str(out / "checkpoints" / "step-000002" / "actor" / "model.safetensors"))
    state = policy.state_dict()
    for name, tensor in trained.items():
        assert torch.equal(state[name], tensor), name
    start, _ = build_preset("tiny-qwen3", seed=0)  # and they moved away from the start
    assert any(not torch.equal(start.state_dict()[n], t) for n, t in trained.items())


def test_a_missing_critic_checkpoint_falls_back_to_the_actor(tmp_path) -> None:
    out = tmp_path / "run"
    ppo = ["algo.advantage=gae", "run.export_hf=false", "run.save_every=1"]
    train(config(out, *ppo, "run.steps=1"))
    shutil.rmtree(out / "checkpoints" / "step-000001" / "actor_critic")
    with pytest.warns(UserWarning, match="actor's weights"):
        train(config(out, *ppo, "run.steps=2"), resume=out)
    assert [r["step"] for r in rows(out)] == [0, 1, 2]
    assert (out / "checkpoints" / "step-000002" / "actor_critic").is_dir()


def test_a_killed_process_resumes_bit_identically(tmp_path) -> None:
    """SIGKILL once the step-3 checkpoint is complete (mid-step 4 to 6, or after)."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    overrides = [*TINY, "task.reward=exact_number"]
    train(load_config(None, [*overrides, f"run.out_dir={straight}"]))
    argv = ["train", *overrides, "run.save_every=3", f"run.out_dir={killed}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same reductions as this process
    proc = subprocess.Popen([sys.executable, "-m", "furlong.cli", *argv], env=env)
    latest = killed / "checkpoints" / "latest"
    try:
        while proc.poll() is None and not latest.exists():
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert cli.main(["train", "--resume", str(killed)]) == 0
    assert_same_run(straight, killed)
