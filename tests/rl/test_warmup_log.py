"""The warm-up's records stream: each step's loss is in warmup.jsonl (and TensorBoard) as the
step finishes, so a crash keeps the steps done; without progress bars a sparse status line
says how far it is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from furlong import metrics
from furlong.metrics import Heartbeat, read_metrics
from furlong.rl.config import load_config
from furlong.rl.loop import train
from furlong.train.engine import TrainingEngine
from tests.rl.conftest import one_step_run

pytestmark = pytest.mark.usefixtures("one_thread")
WARMUP_STEPS = 4


def config(out: Path):
    return load_config(
        None, one_step_run(out, f"warmup.steps={WARMUP_STEPS}", "warmup.batch_size=4")
    )


def tensorboard_losses(out: Path) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(out / "tensorboard" / "warmup"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("warmup/loss")]


def status_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warm-up:")]


def test_a_crash_at_step_k_keeps_the_first_k_records(tmp_path, monkeypatch, capsys) -> None:
    whole = tmp_path / "whole"
    train(config(whole))
    assert status_lines(capsys.readouterr().err) == []  # a short warm-up stays quiet
    full = read_metrics(whole / "warmup.jsonl")
    assert [r["step"] for r in full] == list(range(1, WARMUP_STEPS + 1))
    assert all(r["loss"] > 0 for r in full)

    crashed, k = tmp_path / "crashed", 2
    seen: list[int] = []  # warmup.jsonl's lines when each optimizer step starts
    step = TrainingEngine.optim_step

    def dies_after_k(self, *args, **kwargs):
        seen.append(len((crashed / "warmup.jsonl").read_text().splitlines()))
        if len(seen) > k:
            raise RuntimeError("killed")
        return step(self, *args, **kwargs)

    monkeypatch.setattr(TrainingEngine, "optim_step", dies_after_k)
    with pytest.raises(RuntimeError, match="killed"):
        train(config(crashed))
    assert seen == [0, 1, 2]  # a reader saw each line as its step finished
    assert read_metrics(crashed / "warmup.jsonl") == full[:k]
    want = [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in full[:k]]
    assert tensorboard_losses(crashed) == want


def test_without_progress_bars_a_status_line_comes_every_interval(
    tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setattr(metrics, "HEARTBEAT_SECONDS", 0.0)  # every step is "30 s later"
    out = tmp_path / "run"
    train(config(out))
    err = capsys.readouterr().err
    lines = status_lines(err)
    losses = [r["loss"] for r in read_metrics(out / "warmup.jsonl")]
    rl_lines = [line for line in err.splitlines() if line.startswith("rl:")]  # the RL steps too
    reward = read_metrics(out / "metrics.jsonl")[-1]["reward:mean"]
    assert len(rl_lines) == 1
    assert re.fullmatch(rf"rl: step 1/1, reward {reward:.2f} \(\d+ s\)", rl_lines[0])
    assert len(lines) == WARMUP_STEPS
    for i, (line, loss) in enumerate(zip(lines, losses, strict=True), 1):
        assert re.fullmatch(rf"warm-up: step {i}/{WARMUP_STEPS}, loss {loss:.3f} \(\d+ s\)", line)


def test_the_heartbeat_speaks_once_per_interval(capsys) -> None:
    now = [100.0]
    beat = Heartbeat("warm-up", 150, every=30.0, clock=lambda: now[0])
    for step, t in enumerate([110.0, 129.9, 130.0, 140.0, 175.0], 1):
        now[0] = t
        beat.tick(step, "loss 0.500")
    assert capsys.readouterr().err.splitlines() == [
        "warm-up: step 3/150, loss 0.500 (30 s)",
        "warm-up: step 5/150, loss 0.500 (75 s)",
    ]
