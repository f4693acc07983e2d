"""MetricsLog (JSONL + TensorBoard + wandb), resuming a log, and the curves PNG."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest
from matplotlib.figure import Figure
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from furlong.errors import InputError
from furlong.metrics import MetricsLog, Tracker, WandbSettings, plot_metrics, read_metrics


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard would show for one run directory."""
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_writes_go_to_jsonl_and_tensorboard_with_prefixes(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path)
    warm = MetricsLog(tmp_path / "warmup.jsonl", tracker=tracker)  # prefix: the file's stem
    for step, loss in [(1, 2.5), (2, 1.25), (3, 0.75)]:
        warm.write(step, {"loss": loss})
    log = MetricsLog(tmp_path / "metrics.jsonl", tracker=tracker, prefix="rl")
    log.write(0, {"eval_greedy": 0.125})
    log.write(1, {"reward:mean": 0.5, "kl:mean": float("nan")})
    log.write(2, {"reward:mean": 0.75})
    # read back before close: every write is flushed
    rl = scalars(tmp_path / "tensorboard" / "rl")
    assert rl["rl/reward:mean"] == [(1, 0.5), (2, 0.75)]
    assert rl["rl/eval_greedy"] == [(0, 0.125)]
    assert math.isnan(rl["rl/kl:mean"][0][1])
    warmup = scalars(tmp_path / "tensorboard" / "warmup")
    assert warmup == {"warmup/loss": [(1, 2.5), (2, 1.25), (3, 0.75)]}  # its own step axis
    assert [r["loss"] for r in read_metrics(tmp_path / "warmup.jsonl")] == [2.5, 1.25, 0.75]
    assert read_metrics(tmp_path / "metrics.jsonl")[2] == {"step": 2, "reward:mean": 0.75}
    log.close()
    tracker.close()  # closes warm's writer too; a second close is harmless


def test_without_tracker_only_jsonl(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "m.jsonl")
    log.write(0, {"a": 1})
    assert read_metrics(tmp_path / "m.jsonl") == [{"step": 0, "a": 1.0}]
    assert not (tmp_path / "tensorboard").exists()


def test_new_log_starts_empty_everywhere(tmp_path: Path) -> None:
    with_tb = Tracker(tmp_path)
    MetricsLog(tmp_path / "metrics.jsonl", tracker=with_tb).write(7, {"x": 1.0})
    with_tb.close()
    again = Tracker(tmp_path)
    log = MetricsLog(tmp_path / "metrics.jsonl", tracker=again)
    log.write(1, {"x": 2.0})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "x": 2.0}]
    assert scalars(tmp_path / "tensorboard" / "metrics") == {"metrics/x": [(1, 2.0)]}
    again.close()


def test_resume_keeps_steps_up_to_and_drops_later(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tracker = Tracker(tmp_path)
    log = MetricsLog(path, tracker=tracker, prefix="rl")
    for step in range(6):
        log.write(step, {"reward:mean": step / 8})
    tracker.close()
    with path.open("a") as f:
        f.write('{"step": 6, "reward:me')  # the run died mid-line

    tracker = Tracker(tmp_path)
    resumed = MetricsLog(path, tracker=tracker, prefix="rl", resume_from_step=3)
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]
    resumed.write(4, {"reward:mean": 1.0})
    assert read_metrics(path)[-2:] == [
        {"step": 3, "reward:mean": 0.375},
        {"step": 4, "reward:mean": 1.0},
    ]
    # TensorBoard shows the kept steps and the new one, not the dropped 4-5
    expected = [(0, 0.0), (1, 0.125), (2, 0.25), (3, 0.375), (4, 1.0)]
    assert scalars(tmp_path / "tensorboard" / "rl") == {"rl/reward:mean": expected}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "tensorboard"]
    tracker.close()


def test_resume_without_a_file_starts_empty(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "new.jsonl", resume_from_step=10)
    log.write(11, {"a": 1.0})
    assert read_metrics(tmp_path / "new.jsonl") == [{"step": 11, "a": 1.0}]


def test_resume_rejects_a_corrupt_middle_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError):
        MetricsLog(path, resume_from_step=5)


def test_wandb_disabled_never_imports_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # any `import wandb` now fails
    for off in (None, WandbSettings(), {"enabled": False, "project": "p"}):
        tracker = Tracker(tmp_path, tensorboard=False, wandb=off)
        MetricsLog(tmp_path / "m.jsonl", tracker=tracker).write(0, {"a": 1.0})
        tracker.close()
    with pytest.raises(
        InputError, match=r"run\.wandb is true but the wandb package is not installed"
    ):
        Tracker(tmp_path, tensorboard=False, wandb={"enabled": True})


def test_wandb_rejects_unknown_keys(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"run\.wandb: unknown keys \['projct'\]"):
        Tracker(tmp_path, tensorboard=False, wandb={"enabled": True, "projct": "x"})


class FakeRun:
    def __init__(self, **init: Any):
        self.init, self.defined, self.logged, self.finished = init, [], [], False

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.defined.append((name, step_metric))

    def log(self, data: dict[str, float]) -> None:
        self.logged.append(data)

    def finish(self) -> None:
        self.finished = True


def test_wandb_gets_prefixed_metrics_on_their_own_step_axis(tmp_path: Path, monkeypatch) -> None:
    runs: list[FakeRun] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: runs.append(FakeRun(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    settings = WandbSettings(enabled=True, project="p", mode="offline")
    tracker = Tracker(tmp_path, tensorboard=False, wandb=settings)
    MetricsLog(tmp_path / "warmup.jsonl", tracker=tracker).write(1, {"loss": 2.0})
    MetricsLog(tmp_path / "metrics.jsonl", tracker=tracker, prefix="rl").write(0, {"r": 0.5})
    tracker.close()
    (run,) = runs  # one wandb run for both logs
    assert run.init["mode"] == "offline" and run.init["dir"] == str(tmp_path)
    assert ("rl/*", "rl/step") in run.defined and ("warmup/*", "warmup/step") in run.defined
    assert run.logged == [{"warmup/step": 1, "warmup/loss": 2.0}, {"rl/step": 0, "rl/r": 0.5}]
    assert run.finished


def test_real_wandb_offline(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracker(tmp_path, tensorboard=False, wandb=WandbSettings(True, mode="offline"))
    MetricsLog(tmp_path / "metrics.jsonl", tracker=tracker, prefix="rl").write(3, {"r": 0.5})
    assert tracker.wandb_run.summary["rl/r"] == 0.5
    tracker.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def drawn_figures(monkeypatch) -> list[Figure]:
    """The figures plot_metrics saves, to inspect what was drawn."""
    seen: list[Figure] = []
    save = Figure.savefig

    def spy(self: Figure, *args: Any, **kwargs: Any) -> None:
        seen.append(self)
        save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    return seen


KEYS = ["reward:mean", "eval_greedy", "kl:mean", "entropy:mean", "grad_norm:mean", "x"]


def write_runs(tmp_path: Path) -> tuple[Path, Path]:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in range(5):
        value = float("nan") if step == 2 else step / 4
        log.write(step, {k: value for k in KEYS[:-1]})  # "x" never logged
    warm = MetricsLog(tmp_path / "warmup.jsonl")
    for step, loss in [(1, 3.0), (2, 2.0), (3, 1.5)]:
        warm.write(step, {"loss": loss})
    return log.path, warm.path


def test_plot_is_a_grid_of_labelled_panels(tmp_path: Path, monkeypatch) -> None:
    figures = drawn_figures(monkeypatch)
    metrics, _ = write_runs(tmp_path)
    png = plot_metrics(metrics, tmp_path / "curves.png", KEYS, title="run")
    height, width, _ = matplotlib.image.imread(png).shape
    assert (width, height) == (1320, 660)  # 3 columns x 2 rows of 4.4 x 3.1 in + title
    (fig,) = figures
    assert [ax.get_ylabel() for ax in fig.axes] == KEYS
    assert {ax.get_xlabel() for ax in fig.axes} == {"step"}
    reward = fig.axes[0]
    assert reward.get_title() == "reward:mean (last 1)"
    assert list(reward.lines[0].get_xdata()) == [0, 1, 3, 4]  # the NaN at step 2 is skipped
    assert not fig.axes[-1].lines  # "x" has no data: an empty, labelled panel
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_plot_warmup_panel_comes_first(tmp_path: Path, monkeypatch) -> None:
    figures = drawn_figures(monkeypatch)
    metrics, warmup = write_runs(tmp_path)
    png = plot_metrics(metrics, tmp_path / "curves.png", KEYS, warmup_jsonl=warmup)
    height, width, _ = matplotlib.image.imread(png).shape
    assert (width, height) == (1320, 930)  # 7 panels: a third row, no title
    (fig,) = figures
    first = fig.axes[0]
    assert (first.get_xlabel(), first.get_ylabel()) == ("warm-up step", "loss")
    assert first.get_title().startswith("warm-up loss")
    assert list(first.lines[0].get_xydata().tolist()) == [[1, 3.0], [2, 2.0], [3, 1.5]]
    assert [ax.get_ylabel() for ax in fig.axes[1:]] == KEYS


def test_plot_few_keys_stays_narrow(tmp_path: Path) -> None:
    metrics, _ = write_runs(tmp_path)
    png = plot_metrics(metrics, tmp_path / "curves.png", KEYS[:2])
    height, width, _ = matplotlib.image.imread(png).shape
    assert (width, height) == (880, 310)
