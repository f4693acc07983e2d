"""What a user sees from real processes: `furlong init-model` prints its one line and nothing
else; a `furlong train` run with `run.progress=false` shows no transformers progress bars and,
with `optimizer.state_store=disk`, leaves no empty state directory behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = """\
[model]
name = "tiny-qwen3"
[task]
eval_size = 2
eval_samples = 0
[warmup]
steps = 2
batch_size = 4
[rollout]
prompts_per_step = 2
group_size = 2
max_tokens = 4
[optimizer]
state_store = "disk"
disk_dir = "{disk}"
[run]
steps = 2
eval_every = 2
progress = false
tensorboard = false
out_dir = "{out}"
"""


def _furlong(*args: str) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-m", "furlong", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """Both commands, started side by side (each spends most of its time importing torch)."""
    base = tmp_path_factory.mktemp("quiet")
    (base / "run.toml").write_text(RUN.format(disk=base / "disk", out=base / "out"))
    procs = {
        "init-model": _furlong("init-model", "--preset", "tiny-qwen3", "--out", str(base / "m")),
        "train": _furlong("train", str(base / "run.toml")),
    }
    done = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return base, done


def no_bars(stderr: str) -> bool:
    return "Writing" not in stderr and "it/s]" not in stderr and "\r" not in stderr


def test_init_model_prints_only_its_line(runs) -> None:
    base, done = runs
    result = done["init-model"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"wrote tiny-qwen3 (196,992 parameters, seed 0) to {base / 'm'}"
    ]
    assert result.stderr == ""


def test_a_run_without_progress_shows_no_bars(runs) -> None:
    base, done = runs
    result = done["train"]
    assert result.returncode == 0, result.stderr
    assert no_bars(result.stderr), result.stderr
    assert f"policy: {base / 'out' / 'policy'}" in result.stdout
    assert (base / "out" / "policy" / "config.json").is_file()  # the save did happen
    assert len((base / "out" / "warmup.jsonl").read_text().splitlines()) == 2


def test_disk_optimizer_state_leaves_no_directory(runs) -> None:
    base, done = runs
    assert done["train"].returncode == 0
    assert list((base / "disk").iterdir()) == []  # no optimizer_state/rank... left behind
