"""Data-parallel scaling: tokens/s of ``forward_backward`` on 1 process vs 2 FSDP2 ranks (gloo),
and how much of the 2-rank time is communication.

Two rank processes are spawned once (1 intra-op thread each). Every round runs, in turn:

- ``1 process``: rank 0 alone runs the plain TrainingEngine on the whole batch with 2 threads
  (all the cores, as a single-process run would use them), and again with 1 thread (the
  per-process compute of a rank: the clean scaling baseline); rank 1 waits.
- ``2 ranks``: the DistributedEngine on the whole batch (each rank its share, FSDP2
  all-gathers and reduce-scatters, the outputs gathered).
- ``2 ranks, no comm``: each rank runs the plain engine on its share at the same time, no
  collective at all: what perfect data parallelism would cost.

Reported: median tokens/s per variant, the speedup (1 process s / 2 ranks s, median of per-round
ratios), the communication share by timing (1 - no-comm s / 2-rank s: collectives, FSDP's
copies, waiting for the slower rank) and by the profiler (time inside ``gloo:*`` collectives,
rank 0, one extra iteration), plus the bytes FSDP moves per step and the bandwidth that implies.

Run: ``.venv/bin/python benchmarks/dp_scaling.py [--model small-qwen3] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from furlong.train.distributed import DistributedEngine, init_distributed  # noqa: E402
from furlong.train.engine import EngineConfig, TrainingEngine  # noqa: E402
from furlong.train.rank_split import assign_ranks, rank_microbatches  # noqa: E402
from furlong.types import Datum  # noqa: E402


def batch(n: int, length: int, vocab: int) -> list[Datum]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (length + 1,), generator=g)
        out.append(Datum.next_token(ids, weights=torch.ones(length)))
    return out


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()  # the slower rank decides
    return time.perf_counter() - start


def collective_seconds(engine: DistributedEngine, data: list[Datum]) -> tuple[float, float]:
    """``(seconds inside gloo collectives, iteration seconds)`` of one profiled iteration."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.forward_backward(data, "cross_entropy")
    total = time.perf_counter() - start
    engine.zero_grad()
    comm = sum(e.cpu_time_total for e in prof.key_averages() if e.key.startswith("gloo:"))
    return comm / 1e6, total


def worker(rank: int, args: argparse.Namespace, store: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    init_distributed("gloo", f"file://{store}", rank, 2)
    config = EngineConfig(max_tokens_per_microbatch=args.microbatch_tokens)
    ranked = DistributedEngine.from_pretrained(args.model, config)
    plain = TrainingEngine.from_pretrained(args.model, config)
    data = batch(args.datums, args.length, min(plain.vocab_size, 700))
    share = [data[i] for i in assign_ranks([len(d) for d in data], 2)[rank]]
    tokens = sum(len(d) for d in data)

    def one_process(threads: int) -> None:
        if rank == 0:
            torch.set_num_threads(threads)
            plain.forward_backward(data, "cross_entropy")
            plain.zero_grad()
            torch.set_num_threads(1)

    def two_ranks() -> None:
        ranked.forward_backward(data, "cross_entropy")
        ranked.zero_grad()

    def no_comm() -> None:
        plain.forward_backward(share, "cross_entropy")
        plain.zero_grad()

    variants = {
        "1 process (2 threads)": functools.partial(one_process, 2),
        "1 process (1 thread)": functools.partial(one_process, 1),
        "2 ranks": two_ranks,
        "2 ranks, no comm": no_comm,
    }
    for fn in variants.values():  # warm-up
        timed(fn)
    seconds: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            seconds[name].append(timed(variants[name]))
    comm, total = collective_seconds(ranked, data)
    if rank != 0:
        return
    n_params = sum(p.numel() for p in plain.params)
    microbatches = len(rank_microbatches([len(d) for d in data], 2, args.microbatch_tokens)[0])
    # per microbatch: all-gather in forward and again in backward (layers reshard after
    # forward), one reduce-scatter; each moves (N-1)/N of the fp32 parameters per rank
    moved = n_params * 4 * 3 * microbatches / 2
    base = statistics.median(seconds["1 process (2 threads)"])
    print(
        f"model {args.model} ({n_params / 1e6:.1f} M params), {args.datums} x {args.length} "
        f"tokens per call, {microbatches} microbatch(es) per rank, {args.rounds} rounds"
    )
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}")
    print()
    print("| variant | s / call (median) | tokens/s | vs 1 process |")
    print("|---|---:|---:|---:|")
    for name, values in seconds.items():
        s = statistics.median(values)
        print(f"| {name} | {s:.3f} | {tokens / s:,.0f} | {base / s:.2f}x |")
    ratios = [
        a / b for a, b in zip(seconds["1 process (2 threads)"], seconds["2 ranks"], strict=True)
    ]
    per_thread = [
        a / b for a, b in zip(seconds["1 process (1 thread)"], seconds["2 ranks"], strict=True)
    ]
    share_timing = [
        1 - a / b for a, b in zip(seconds["2 ranks, no comm"], seconds["2 ranks"], strict=True)
    ]
    print()
    speedup, share = statistics.median(ratios), statistics.median(share_timing)
    print(f"speedup 2 ranks / 1 process (median of per-round ratios): {speedup:.2f}x")
    print(
        f"scaling 2 ranks / 1 process at 1 thread (ideal 2x): {statistics.median(per_thread):.2f}x"
    )
    print(f"communication share by timing (1 - no-comm / 2 ranks): {share:.0%}")
    print(
        f"communication share by profiler (gloo collectives, rank 0): {comm / total:.0%} "
        f"({comm * 1e3:.0f} of {total * 1e3:.0f} ms)"
    )
    print(
        f"FSDP traffic per rank per call: {moved / 2**20:.1f} MiB -> "
        f"{moved / max(comm, 1e-9) / 2**30:.2f} GiB/s effective over gloo"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="small-qwen3")
    parser.add_argument("--datums", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--microbatch-tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, os.path.join(tmp, "store")), nprocs=2)


if __name__ == "__main__":
    main()
