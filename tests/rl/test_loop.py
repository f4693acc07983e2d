"""Short end-to-end RL runs on the tiny model: GRPO and PPO-with-critic improve a trivially
learnable reward; the run writes metrics JSONL, a plot and an HF policy that transformers loads."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from furlong.rl import tasks
from furlong.rl.config import load_config
from furlong.rl.loop import train

pytestmark = pytest.mark.usefixtures("one_thread")


def run(tmp_path, *overrides: str):
    config = load_config(
        None,
        [
            "model.name=tiny-qwen3",
            "task.reward=short_text",
            "task.eval_size=8",
            "task.eval_samples=2",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.max_tokens=6",
            "algo.learning_rate=1e-2",
            "run.steps=16",
            "run.eval_every=8",
            "run.progress=false",
            f"run.out_dir={tmp_path}",
            *overrides,
        ],
    )
    summary = train(config)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward:mean"] for r in rows if "reward:mean" in r]
    return summary, rows, rewards


def test_grpo_improves_the_reward_and_writes_its_outputs(tmp_path, short_reward) -> None:
    summary, rows, rewards = run(tmp_path)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1
    assert summary.after["eval_greedy"] >= summary.before["eval_greedy"]
    assert rows[0]["step"] == 0 and "eval_greedy" in rows[0] and "eval_pass1" in rows[0]
    for key in ("entropy:mean", "grad_norm:mean", "rollout_tokens_per_s", "step_seconds"):
        assert key in rows[1]
    assert (tmp_path / "curves.png").stat().st_size > 1000
    policy = AutoModelForCausalLM.from_pretrained(summary.hf_dir)
    assert policy(torch.tensor([[1, 2, 3]])).logits.shape[-1] == 768


def test_ppo_with_a_critic_improves_the_reward(tmp_path, short_reward) -> None:
    summary, rows, rewards = run(
        tmp_path,
        "algo.advantage=gae",
        "algo.objective=ppo",
        "algo.minibatches=2",
        "critic.warmup_steps=1",
        "colocate.enabled=true",
        "run.export_hf=false",
    )
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1
    assert "value_loss:sum" in rows[1] and "grad_norm:mean" not in rows[1]  # critic-only step
    assert "grad_norm:mean" in rows[2]
    assert rows[2]["host_peak_bytes:max"] > 0  # the colocated hand-off ran
    assert summary.hf_dir is None


def test_moe_with_top_p_and_kl_replays_masks_and_routes(tmp_path, short_reward) -> None:
    """Sampling-mask replay (top-p < 1) and routing replay (MoE) keep the trainer on the
    rollout's distribution: its log-probs of the sampled tokens match the rollout's, and the
    KL to the frozen start is zero at step 1 (same weights, same kept sets) and grows."""
    _, rows, _ = run(
        tmp_path,
        "model.name=tiny-qwen3-moe",
        "rollout.top_p=0.8",
        "algo.kl_coef=0.05",
        "run.steps=6",
        "run.eval_every=6",
        "run.export_hf=false",
    )
    steps = [r for r in rows if r["step"] > 0]
    assert all(r["logprob_diff:mean"] < 1e-4 for r in steps)
    assert abs(steps[0]["kl:mean"]) < 1e-5
    assert steps[-1]["kl:mean"] > 1e-3


def test_a_batch_without_signal_takes_no_step(tmp_path, monkeypatch) -> None:
    """All rewards equal: every advantage is zero, and the policy must not move (a zero
    gradient would still move Adam's parameters through its momentum after earlier steps)."""
    from furlong.models import build_preset

    monkeypatch.setitem(tasks.REWARDS, "constant", lambda response, problem: 1.0)
    summary, rows, _ = run(tmp_path, "task.reward=constant", "run.steps=3", "run.eval_every=3")
    assert [r["actor_skipped:sum"] for r in rows[1:]] == [1.0, 1.0, 1.0]
    assert all("grad_norm:mean" not in r for r in rows[1:])
    start, _ = build_preset("tiny-qwen3", seed=0)
    final = AutoModelForCausalLM.from_pretrained(summary.hf_dir)
    for name, p in start.state_dict().items():
        assert torch.equal(final.state_dict()[name], p), name


def test_muon_with_disk_state_and_colocation(tmp_path, short_reward) -> None:
    """The [optimizer] group reaches the actor: Muon, its state in file-backed mappings that
    the colocated hand-off leaves where they are (they are never counted as moved)."""
    state = tmp_path / "state"
    state.mkdir()
    out = tmp_path / "run"
    summary, rows, rewards = run(
        out,
        "optimizer.kind=muon",
        "optimizer.state_store=disk",
        f'optimizer.disk_dir="{state}"',
        "colocate.enabled=true",
        "run.steps=8",
        "run.eval_every=8",
        "run.export_hf=false",
    )
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3
    assert all(torch.isfinite(torch.tensor(r["grad_norm:mean"])) for r in rows[1:])
    assert rows[-1]["host_peak_bytes:max"] > 0
    assert (state / "optimizer_state").is_dir()  # the per-process directory was made there


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_bf16_policy_learns_with_fp32_masters(tmp_path, short_reward, algo: str) -> None:
    """model.dtype=bfloat16: the policy (and the rollout that shares it), reference and critic
    in bf16, every optimizer on fp32 masters; PPO's critic and the colocated hand-off too."""
    ppo = ["algo.advantage=gae", "algo.objective=ppo", "critic.warmup_steps=1"]
    extra = [*ppo, "colocate.enabled=true", "run.log_kl=true"] if algo == "ppo" else []
    summary, rows, rewards = run(tmp_path, "model.dtype=bfloat16", *extra)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1
    policy = AutoModelForCausalLM.from_pretrained(summary.hf_dir)
    assert policy.dtype == torch.bfloat16  # the export keeps the model's precision
