"""The demo's recipe learns whatever the CPU's rounding: a short budget of it, in fresh processes
under two kernel sets that round differently (no SIMD, and this CPU's best) and two seeds, lifts
held-out greedy accuracy by at least 30 points in every cell. The full matrix (3 seeds x 2 thread
counts x every kernel set, the whole budget) is benchmarks/demo_robustness.py."""

from __future__ import annotations

from pathlib import Path

from furlong import cpu_kernels
from furlong.rl.robustness import Cell, run_matrix

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "rl" / "reverse.toml"
SHORT = ["run.steps=20", "run.eval_every=20", "run.log_kl=false"]


def test_kernel_sets_round_differently() -> None:
    """Without this, the matrix below would test one rounding twice."""
    assert cpu_kernels.available()[0] == "default"
    env = cpu_kernels.environment("default", threads=1)
    assert env["ATEN_CPU_CAPABILITY"] == "default" and env["OMP_NUM_THREADS"] == "1"


def test_a_short_budget_lifts_held_out_accuracy_under_every_rounding(tmp_path) -> None:
    kernels = sorted({"default", cpu_kernels.best()}, key=list(cpu_kernels.KERNEL_SETS).index)
    threads = 1 if len(kernels) > 1 else 2  # an AVX-less CPU: the thread count changes rounding
    cells = [Cell(k, threads, seed) for k in kernels for seed in (0, 1)]
    if len(kernels) == 1:
        cells += [Cell(kernels[0], 1, seed) for seed in (0, 1)]
    done = run_matrix(cells, RECIPE, SHORT, tmp_path)
    for cell in done:
        assert 0.10 <= cell.before <= 0.60, cell  # the warm-up lands mid-way (16-45% measured)
        assert cell.lift >= 0.30, cell
