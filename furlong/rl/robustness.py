"""A recipe under one SIMD kernel set, thread count and seed, in a fresh process: the unit of the
check that a learning claim holds on any CPU (``benchmarks/demo_robustness.py``, the slow tier).

Each cell runs ``furlong train RECIPE`` with ``model.seed = run.seed = SEED`` in a child process
whose environment caps the kernels (``furlong.cpu_kernels``) and the intra-op threads, and reads
held-out greedy accuracy at step 0 (after the warm-up) and at the end from its ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from furlong import cpu_kernels

QUIET = ["run.progress=false", "run.export_hf=false", "run.tensorboard=false"]


@dataclass(frozen=True)
class Cell:
    kernels: str  # a name in cpu_kernels.KERNEL_SETS
    threads: int
    seed: int
    before: float = float("nan")  # held-out greedy after the warm-up, before RL
    after: float = float("nan")  # ... at the end of RL
    seconds: float = float("nan")  # the child's wall time

    @property
    def lift(self) -> float:
        return self.after - self.before


def run_cell(cell: Cell, recipe: Path, overrides: Sequence[str], work: Path) -> Cell:
    """``cell`` with its measurements; ``overrides`` apply after the seeds."""
    out = work / f"{cell.kernels}-t{cell.threads}-s{cell.seed}"
    settings = [f"model.seed={cell.seed}", f"run.seed={cell.seed}", f"run.out_dir={out}"]
    command = [sys.executable, "-m", "furlong", "train", str(recipe), *settings, *QUIET]
    env = cpu_kernels.environment(cell.kernels, cell.threads)
    start = time.perf_counter()
    done = subprocess.run([*command, *overrides], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{cell} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    greedy = [row["eval_greedy"] for row in rows if "eval_greedy" in row]
    return Cell(cell.kernels, cell.threads, cell.seed, greedy[0], greedy[-1], seconds)


def run_matrix(
    cells: Sequence[Cell],
    recipe: Path,
    overrides: Sequence[str],
    work: Path,
    cores: int = 2,
    on_done: Callable[[Cell], None] = lambda cell: None,
) -> list[Cell]:
    """Every cell, as many at a time as keep the busy threads within ``cores``."""
    done: list[Cell] = []
    for threads in sorted({c.threads for c in cells}):
        group = [c for c in cells if c.threads == threads]
        with ThreadPoolExecutor(max(1, cores // threads)) as pool:
            for cell in pool.map(lambda c: run_cell(c, recipe, overrides, work), group):
                on_done(cell)
                done.append(cell)
    return done
