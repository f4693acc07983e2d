"""`furlong init-model` as a real process and in-process, bad arguments, and the demo smoke."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from furlong import cli
from furlong.demo import demo_config, run_demo
from furlong.metrics import read_metrics
from furlong.models import PRESETS, build_preset
from furlong.rl.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SUBPROCESS_PRESETS = ["tiny-qwen3", "tiny-qwen3-moe"]
BAD = "no-such-preset"


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _furlong(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "furlong", *args],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Real `python -m furlong init-model` processes, started side by side (each spends most
    of its time importing torch and transformers): one per preset and one with a bad name."""
    base = tmp_path_factory.mktemp("cli")
    procs = {
        name: (base / name, _furlong("init-model", "--preset", name, "--out", str(base / name)))
        for name in [*SUBPROCESS_PRESETS, BAD]
    }
    done = {}
    for name, (out, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        done[name] = (out, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return done


@pytest.mark.parametrize("name", SUBPROCESS_PRESETS)
def test_init_model_subprocess(runs, name: str) -> None:
    out, result = runs[name]
    assert result.returncode == 0, result.stderr
    assert any(name in line and "wrote" in line for line in result.stdout.splitlines())
    assert (out / "config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ref, ref_tok = build_preset(name, seed=0)
    assert type(model) is type(ref)
    assert tokenizer.get_vocab() == ref_tok.get_vocab()
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert not [p.name for p in out.parent.iterdir() if ".tmp-" in p.name]


def test_init_model_in_process(tmp_path: Path, capsys) -> None:
    out = tmp_path / "m"
    rc = cli.main(["init-model", "--preset", "tiny-qwen3", "--out", str(out), "--seed", "3"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tiny-qwen3" in printed
    assert "seed 3" in printed
    model = AutoModelForCausalLM.from_pretrained(out)
    ref, _ = build_preset("tiny-qwen3", seed=3)
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight)


def test_bad_preset_in_process(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["init-model", "--preset", "no-such-preset", "--out", str(tmp_path / "m")])
    assert info.value.code != 0
    err = capsys.readouterr().err
    assert "invalid choice" in err
    assert "no-such-preset" in err
    for name in PRESETS:
        assert name in err
    assert not (tmp_path / "m").exists()


def test_missing_arguments_in_process(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["init-model", "--preset", "tiny-qwen3"])
    assert info.value.code != 0
    assert "--out" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code != 0


def test_bad_preset_subprocess(runs) -> None:
    out, result = runs[BAD]
    assert result.returncode == 2
    assert "invalid choice" in result.stderr
    assert BAD in result.stderr
    for name in PRESETS:
        assert name in result.stderr
    assert not out.exists()


def test_demo_smoke(tmp_path: Path, capsys) -> None:
    """The demo's pipeline at toy size: warm-up, RL, summary, and outputs that parse."""
    config = demo_config(
        "grpo",
        str(tmp_path),
        "model.name=tiny-qwen3",
        "warmup.steps=4",
        "task.eval_size=8",
        "task.eval_samples=1",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "run.steps=3",
        "run.eval_every=2",
        "run.progress=false",
    )
    summary = run_demo(config)
    printed = capsys.readouterr().out
    assert "held-out greedy" in printed and "held-out pass1" in printed
    assert (
        summary.before.keys()
        == summary.after.keys()
        == {"eval_greedy", "eval_solved", "eval_stopped", "eval_pass1"}
    )

    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["eval_greedy"] == summary.before["eval_greedy"]
    assert rows[-1]["eval_greedy"] == summary.after["eval_greedy"]
    for r in rows[1:]:
        keys = ["reward:mean", "entropy:mean", "rollout_tokens_per_s", "actor_skipped:sum"]
        if not r["actor_skipped:sum"]:  # a batch without signal takes no step
            keys.append("grad_norm:mean")
        for key in keys:
            assert torch.isfinite(torch.tensor(r[key])), key
    assert "eval_pass1" in rows[2] and "eval_pass1" not in rows[1]
    warm = read_metrics(tmp_path / "warmup.jsonl")
    assert [r["step"] for r in warm] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in warm)

    assert load_config(tmp_path / "config.toml") == config  # the run can be rerun as is

    png = tmp_path / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert AutoModelForCausalLM.from_pretrained(summary.hf_dir).config.vocab_size == 768
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_demo_rejects_a_bad_override(capsys) -> None:
    assert cli.main(["demo", "--out", "/nonexistent/x", "rollout.group_size=1"]) == 2
    assert "rollout.group_size" in capsys.readouterr().err


def test_session_server_needs_an_explicit_pause_mode(capsys) -> None:
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["session-server", "--model", "tiny-qwen3"])
    assert "--pause-mode" in capsys.readouterr().err
    args = parser.parse_args(["session-server", "--pause-mode", "retract"])
    assert args.pause_mode == "retract"
