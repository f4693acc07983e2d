"""RL step time of furlong's GRPO loop (tiny-qwen3, in process), this checkout against a
baseline checkout (e.g. a ``git worktree`` of an older commit), run alternately in one
invocation so both see the same machine:

    .venv/bin/python benchmarks/loop_step.py --baseline-checkout /tmp/before --rounds 5

Each run is a fresh interpreter with that checkout first on ``sys.path``; it trains
``--steps`` steps and reports the mean ``step_seconds`` after the first two. The result is the
median per side and their ratio (this / baseline; below 1 is faster)."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ONE_RUN = """
import json, sys, tempfile, torch
from pathlib import Path
torch.set_num_threads(1)
from furlong.rl import tasks
from furlong.rl.config import load_config
from furlong.rl.loop import train
tasks.REWARDS["short_text"] = lambda response, problem: -len(response) / 10
out = Path(tempfile.mkdtemp())
steps = int(sys.argv[1])
train(load_config(None, [
    "model.name=tiny-qwen3", "task.reward=short_text", "task.eval_size=4",
    "task.eval_samples=0", "rollout.prompts_per_step=8", "rollout.group_size=4",
    "rollout.max_tokens=16", f"run.steps={steps}", f"run.eval_every={steps}",
    "run.progress=false", "run.export_hf=false", f"run.out_dir={out}",
]))
rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
timed = [r["step_seconds"] for r in rows if r.get("step", 0) > 2 and "step_seconds" in r]
print(json.dumps(sum(timed) / len(timed)))
"""


def one_run(checkout: Path, steps: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", ONE_RUN, str(steps)]
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--baseline-checkout", required=True, help="the tree to compare with")
    parser.add_argument("--rounds", type=int, default=5, help="runs per side, alternating")
    parser.add_argument("--steps", type=int, default=12, help="RL steps per run (3 and up timed)")
    args = parser.parse_args()
    sides = {"baseline": Path(args.baseline_checkout).resolve(), "this": ROOT}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(args.rounds):
        for name in sides if i % 2 == 0 else reversed(list(sides)):
            times[name].append(one_run(sides[name], args.steps))
            print(f"round {i + 1} {name:8s} {times[name][-1]:.4f} s/step", flush=True)
    base, this = (statistics.median(times[n]) for n in ("baseline", "this"))
    print(f"median s/step: baseline {base:.4f}  this {this:.4f}  ratio {this / base:.3f}")


if __name__ == "__main__":
    main()
