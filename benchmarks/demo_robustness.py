"""Does the demo learn on every CPU? Its recipe over seeds x intra-op threads x SIMD kernel sets.

Floats round differently under another kernel set (``furlong.cpu_kernels``) or thread count, so
one machine's run says little. Each cell runs ``furlong train examples/rl/reverse.toml`` (the
demo's recipe; ``--algo ppo`` adds the PPO demo's settings) in a fresh process with
``model.seed = run.seed = SEED`` under one kernel set and thread count, and reads held-out greedy
accuracy before RL (after the warm-up) and at the end from its ``metrics.jsonl``. Every cell must
lift it by ``--min-lift`` points (30 by default); the exit status is 1 otherwise. ``--recipe``
checks another config the same way (e.g. a recorded run's ``docs/recipes/runs/*/config.toml``).

Cells with one thread run ``--jobs`` at a time (one a core); a cell's seconds are its wall time
under that sharing. The table is printed as Markdown (for BENCHMARKS.md) and the cells are
written as JSONL to ``--out``.

    .venv/bin/python benchmarks/demo_robustness.py                 # 3 seeds x 2 threads x all sets
    .venv/bin/python benchmarks/demo_robustness.py --algo ppo --seeds 0 1 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from furlong import cpu_kernels  # noqa: E402
from furlong.demo import PPO  # noqa: E402
from furlong.rl.robustness import Cell, run_matrix  # noqa: E402

RECIPE = ROOT / "examples" / "rl" / "reverse.toml"


def _row(c: Cell) -> str:
    cells = [c.kernels, c.threads, c.seed, f"{c.before:.0%}", f"{c.after:.0%}"]
    cells += [f"{100 * c.lift:+.0f}", f"{c.seconds:.0f}"]
    return "| " + " | ".join(map(str, cells)) + " |"


def summary(cells: list[Cell]) -> str:
    def stat(name: str, values: list[float]) -> str:
        return f"{name} median {statistics.median(values):.0%}, min {min(values):.0%}"

    lifts = [100 * c.lift for c in cells]
    return "; ".join(
        [
            stat("before", [c.before for c in cells]),
            stat("after", [c.after for c in cells]),
            f"lift median {statistics.median(lifts):+.0f}, min {min(lifts):+.0f} points",
            f"cell time median {statistics.median(c.seconds for c in cells):.0f} s",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--recipe", type=Path, default=RECIPE, help="a furlong train config")
    parser.add_argument("--algo", choices=("grpo", "ppo"), default="grpo")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--kernels", nargs="+", default=cpu_kernels.available())
    parser.add_argument("--jobs", type=int, default=2, help="cores to share between cells")
    parser.add_argument("--min-lift", type=float, default=30.0, help="points, every cell")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "demo_robustness.jsonl")
    parser.add_argument("overrides", nargs="*", help="more key=value settings for every cell")
    args = parser.parse_args()
    # key=value words after --kernels land in its list: they are overrides
    args.overrides += [k for k in args.kernels if "=" in k]
    args.kernels = [k for k in args.kernels if "=" not in k] or cpu_kernels.available()
    unknown = set(args.kernels) - set(cpu_kernels.available())
    if unknown:
        parser.error(f"--kernels: {sorted(unknown)} not runnable here ({cpu_kernels.available()})")
    cells = [Cell(k, t, s) for t in args.threads for k in args.kernels for s in args.seeds]
    print(f"{args.recipe.name}, {args.algo}: {len(cells)} cells; best kernels {cpu_kernels.best()}")
    print("| kernels | threads | seed | before | after | lift | s |\n|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="furlong-robust-") as work:
        extra = (PPO if args.algo == "ppo" else []) + args.overrides
        done = run_matrix(
            cells, args.recipe, extra, Path(work), args.jobs, lambda c: print(_row(c), flush=True)
        )
    print(summary(done))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(asdict(c) | {"algo": args.algo}) + "\n" for c in done))
    failed = [c for c in done if 100 * c.lift < args.min_lift]
    for c in failed:
        print(f"FAILED: {c.kernels}, {c.threads} threads, seed {c.seed}: lift {100 * c.lift:+.0f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
