"""Run metrics: one JSON object per step in a JSONL file, and a PNG plot of chosen curves."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path


class MetricsLog:
    """Appends ``{"step": n, ...}`` lines; each line is flushed so a crash loses nothing."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")


def read_metrics(path: str | os.PathLike) -> list[dict[str, float]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_metrics(
    jsonl: str | os.PathLike, png: str | os.PathLike, keys: Sequence[str], title: str = ""
) -> Path:
    """One panel per key against ``step``; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(jsonl)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        points = [(r["step"], r[key]) for r in rows if key in r and math.isfinite(r[key])]
        if points:
            ax.plot(*zip(*points, strict=True), marker=".", linewidth=1)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(png)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)
    return out
