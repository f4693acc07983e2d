"""Host heap settings vs a training step's speed: small-qwen3, full fine-tuning, one forward +
backward of ``--batch`` x ``--tokens`` on a worker thread (where the service and engines
compute), in a fresh process per setting, alternating over ``--rounds``:

- ``default``: glibc's malloc as it starts;
- ``keep``: ``furlong.host_memory.keep_freed_blocks()`` (every block from one heap, never
  trimmed).

Prints each setting's median step time, page faults per step and peak RSS, and the ratio
default / keep per round. Tests never assert on time; this is where the claim in
docs/memory.md is measured.

Run: ``.venv/bin/python benchmarks/host_heap.py [--batch 64 --tokens 512 --rounds 2]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = """
import json, resource, statistics, sys, threading, time, torch
from furlong import host_memory
setting, dtype, batch, tokens, steps, threads = sys.argv[1:7]
torch.set_num_threads(int(threads))
if setting == "keep":
    assert host_memory.keep_freed_blocks()
from furlong.models.fast_forward import FastForward
from furlong.models.loading import load_model

model, _ = load_model("small-qwen3", seed=0, dtype=getattr(torch, dtype))
hidden = FastForward(model).hidden
batch, tokens = int(batch), int(tokens)
ids = torch.randint(1, 700, (batch, tokens))
mask = torch.ones(batch, tokens, dtype=torch.long)
pos = torch.arange(tokens).expand(batch, tokens)

def step():
    hidden(ids, mask, pos).float().square().mean().backward()
    model.zero_grad(set_to_none=True)

out = {}
def work():
    step()
    times, before = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(int(steps)):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    out.update(seconds=statistics.median(times), faults=faults / int(steps))

thread = threading.Thread(target=work)
thread.start()
thread.join()
assert "seconds" in out, "the worker thread failed"
out["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def run(setting: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-c", WORKER, setting, args.dtype, str(args.batch), str(args.tokens)]
    cmd += [str(args.steps), str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(
        f"small-qwen3 full fine-tuning, {args.batch} x {args.tokens} tokens, {args.dtype}, "
        f"{args.threads} thread(s), on a worker thread; 1 warm-up + {args.steps} timed steps"
    )
    ratios = []
    for r in range(args.rounds):
        got = {
            s: run(s, args) for s in (("default", "keep") if r % 2 == 0 else ("keep", "default"))
        }
        ratios.append(got["default"]["seconds"] / got["keep"]["seconds"])
        for s in ("default", "keep"):
            g = got[s]
            print(
                f"round {r + 1}: {s:8s} {g['seconds']:.3f} s/step  {g['faults']:9.0f} faults/step"
                f"  peak {g['peak_mb']:.0f} MB"
            )
    print(
        f"default / keep: median {statistics.median(ratios):.2f}x (per round: "
        + ", ".join(f"{x:.2f}" for x in ratios)
        + ")"
    )


if __name__ == "__main__":
    main()
