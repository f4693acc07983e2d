"""Run metrics: one JSON object per step in a JSONL file, mirrored to TensorBoard (and wandb when
enabled), and a PNG plot of the curves a person would look at.

The JSONL file is the record; the trackers are views of it. A run's wiring::

    tracker = Tracker(out, tensorboard=True, wandb=None)   # events under out/tensorboard/
    log = MetricsLog(out / "metrics.jsonl", tracker=tracker, prefix="rl")
    log.write(step, {"reward:mean": 0.5})                  # JSONL + tag "rl/reward:mean"
    tracker.close()
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from furlong.atomic import atomic_write_text, replacing
from furlong.errors import InputError

EVENTS_GLOB = "events.out.tfevents.*"
HEARTBEAT_SECONDS = 30.0  # with progress bars off: a status line at most this often
PANEL_IN = (4.4, 3.1)  # one panel's width and height in inches (at dpi 100)
MAX_COLUMNS = 3  # 3 panels a row: ~13 in wide, fits a laptop screen


# ---------------------------------------------------------------- trackers


@dataclass(frozen=True)
class WandbSettings:
    """Weights & Biases logging; off unless ``enabled``. ``mode`` None leaves it to wandb
    (``WANDB_MODE``, else online); "offline" writes the run under ``<out>/wandb`` for a later
    ``wandb sync``. With ``id`` set, a restarted run logs on to that wandb run
    (``resume="allow"``); without it each start is a new wandb run."""

    enabled: bool = False
    project: str = "furlong"
    entity: str | None = None
    name: str | None = None
    mode: str | None = None  # "online" | "offline" | "disabled" | None
    id: str | None = None


def wandb_settings(value: WandbSettings | Mapping[str, Any] | None) -> WandbSettings:
    """A config value (settings, a TOML table or None) as settings; unknown keys are errors."""
    if value is None:
        return WandbSettings()
    if isinstance(value, WandbSettings):
        return value
    known = {f.name for f in dataclasses.fields(WandbSettings)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InputError(f"run.wandb: unknown keys {unknown}; expected some of {sorted(known)}")
    return WandbSettings(**value)


def _import_wandb() -> Any:
    try:
        return importlib.import_module("wandb")
    except ImportError as e:
        raise InputError(
            "run.wandb is true but the wandb package is not installed: "
            "`pip install wandb`, or set run.wandb=false"
        ) from e


class Tracker:
    """The trackers a run's metric logs mirror to: TensorBoard event files under
    ``<out_dir>/tensorboard/<prefix>/`` (one TensorBoard run per log, so each keeps its own step
    axis and can be rewound alone) and one wandb run shared by all logs. wandb is imported only
    when enabled. ``close()`` flushes and closes everything."""

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        tensorboard: bool = True,
        wandb: WandbSettings | Mapping[str, Any] | None = None,
    ):
        self.out_dir = Path(out_dir)
        self.tensorboard_dir = self.out_dir / "tensorboard" if tensorboard else None
        self.wandb_run = self._start_wandb(wandb_settings(wandb))
        self._writers: list[Any] = []

    def _start_wandb(self, settings: WandbSettings) -> Any:
        if not settings.enabled:
            return None
        wandb = _import_wandb()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        return wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=settings.name,
            mode=settings.mode,
            id=settings.id,
            resume="allow" if settings.id else None,
            dir=str(self.out_dir),
        )

    def open_tensorboard(self, prefix: str) -> Any:
        """A fresh SummaryWriter for ``prefix``: earlier event files of that prefix are removed
        (the caller replays what it keeps), so a restart never shows stale points."""
        if self.tensorboard_dir is None:
            return None
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: ~2 s

        run_dir = self.tensorboard_dir / prefix
        for stale in run_dir.glob(EVENTS_GLOB):
            stale.unlink()
        writer = SummaryWriter(str(run_dir))
        self._writers.append(writer)
        return writer

    def define_step(self, prefix: str) -> None:
        """Each prefix plots against its own ``<prefix>/step`` in wandb (warm-up and RL steps
        both start at 0; wandb's own step must only grow)."""
        if self.wandb_run is not None:
            self.wandb_run.define_metric(f"{prefix}/step")
            self.wandb_run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/step")

    def log_wandb(self, prefix: str, step: int, metrics: Mapping[str, float]) -> None:
        if self.wandb_run is not None:
            self.wandb_run.log({f"{prefix}/step": step, **_tagged(prefix, metrics)})

    def close(self) -> None:
        for writer in self._writers:
            writer.close()
        self._writers.clear()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _tagged(prefix: str, metrics: Mapping[str, float]) -> dict[str, float]:
    # "rl/reward:mean": TensorBoard and wandb group panels by the part before the first "/"
    return {f"{prefix}/{k}": float(v) for k, v in metrics.items()}


# ---------------------------------------------------------------- the log


class MetricsLog:
    """Appends ``{"step": n, ...}`` lines; each line is flushed so a crash loses nothing.

    A new log starts empty. ``resume_from_step=s`` continues an existing one instead: lines with
    step <= s are kept (the file is rewritten atomically; a torn last line from a crash is
    dropped) and later ones dropped, then writes append. With a ``tracker`` every write also
    goes to TensorBoard as scalars tagged ``<prefix>/<metric>`` (``prefix`` defaults to the file's
    stem, e.g. "warmup") and to wandb; on resume the kept lines are replayed into TensorBoard.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        tracker: Tracker | None = None,
        prefix: str | None = None,
        resume_from_step: int | None = None,
    ):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix or self.path.stem
        if "/" in self.prefix or self.prefix in (".", ".."):
            raise ValueError(f"prefix must be a plain name, got {self.prefix!r}")
        kept = kept_lines(self.path, resume_from_step) if resume_from_step is not None else []
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        self.tracker = tracker
        self._tb = tracker.open_tensorboard(self.prefix) if tracker else None
        if tracker:
            tracker.define_step(self.prefix)
        for row in map(json.loads, kept):
            self._write_tensorboard(int(row.pop("step")), row)
        if self._tb is not None:
            self._tb.flush()

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        values = {k: float(v) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        self._write_tensorboard(step, values)
        if self._tb is not None:
            self._tb.flush()  # a crash loses nothing here either
        if self.tracker:
            self.tracker.log_wandb(self.prefix, step, values)

    def _write_tensorboard(self, step: int, values: Mapping[str, float]) -> None:
        if self._tb is not None:
            for tag, value in _tagged(self.prefix, values).items():
                self._tb.add_scalar(tag, value, step)

    def close(self) -> None:
        """Closes this log's TensorBoard writer (the tracker's wandb run stays open)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def kept_lines(path: Path, last_step: int) -> list[str]:
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # the line being written when the run died
                break
            raise
        if row["step"] <= last_step:
            kept.append(line)
    return kept


def read_metrics(path: str | os.PathLike) -> list[dict[str, float]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class Heartbeat:
    """With progress bars off, long work still says where it is: a line on stderr when
    ``every`` seconds (default ``HEARTBEAT_SECONDS``) have passed since the last one, e.g.
    ``warm-up: step 40/150, loss 0.812 (31 s)``. Sparse, so a redirected log stays short."""

    def __init__(
        self,
        name: str,
        total: int,
        every: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.name, self.total, self.clock = name, total, clock
        self.every = HEARTBEAT_SECONDS if every is None else every
        self._start = self._last = clock()

    def tick(self, step: int, note: str = "") -> None:
        now = self.clock()
        if now - self._last < self.every:
            return
        self._last = now
        detail = f", {note}" if note else ""
        line = f"{self.name}: step {step}/{self.total}{detail} ({now - self._start:.0f} s)"
        print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the plot


def plot_metrics(
    jsonl: str | os.PathLike,
    png: str | os.PathLike,
    keys: Sequence[str],
    title: str = "",
    warmup_jsonl: str | os.PathLike | None = None,
) -> Path:
    """One panel per key against ``step`` in a grid of up to 3 columns, plus the warm-up loss as
    the first panel when ``warmup_jsonl`` is given; non-finite points are skipped. Written
    atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(jsonl)
    panels = [(key, "step", _points(rows, key), key) for key in keys]
    if warmup_jsonl is not None:
        warm = _points(read_metrics(warmup_jsonl), "loss")
        panels.insert(0, ("warm-up loss", "warm-up step", warm, "loss"))
    fig = _grid(plt, len(panels), title)
    for ax, (name, xlabel, points, ylabel) in zip(fig.axes, panels, strict=False):
        _panel(ax, name, xlabel, ylabel, points)
    fig.tight_layout()
    out = Path(png)
    try:
        with replacing(out) as tmp:
            fig.savefig(tmp, dpi=100, format=out.suffix[1:] or "png")
    finally:
        plt.close(fig)
    return out


def _points(rows: list[dict[str, float]], key: str) -> list[tuple[float, float]]:
    return [(r["step"], r[key]) for r in rows if key in r and math.isfinite(r[key])]


def _grid(plt: Any, n: int, title: str) -> Any:
    columns = max(1, min(MAX_COLUMNS, n))
    grid_rows = max(1, math.ceil(n / columns))
    size = (PANEL_IN[0] * columns, PANEL_IN[1] * grid_rows + (0.4 if title else 0.0))
    fig, axes = plt.subplots(grid_rows, columns, figsize=size, squeeze=False)
    for ax in axes.flat[n:]:
        fig.delaxes(ax)  # the last row's empty slots
    if title:
        fig.suptitle(title)
    return fig


def _panel(ax: Any, name: str, xlabel: str, ylabel: str, points: list[tuple[float, float]]) -> None:
    from matplotlib.ticker import MaxNLocator

    if points:
        ax.plot(*zip(*points, strict=True), marker=".", markersize=3, linewidth=1)
        ax.set_title(f"{name} (last {points[-1][1]:.3g})", fontsize=10)
    else:
        ax.set_title(name, fontsize=10)
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.grid(alpha=0.3)
