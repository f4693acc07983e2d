"""Optimizer state in memory vs in file-backed mappings (``state_store="disk"``).

An AdamW over ``--state-gib`` of optimizer state (exp_avg + exp_avg_sq: the parameters are half
that, as 4 MiB fp32 matrices) steps through furlong's ``optimizer_step`` with AdamParams.
Every parameter gets the same gradient tensor each step (so no clipping), so gradients cost
4 MiB and the anonymous memory the state adds stands out. Each variant runs in a fresh subprocess
(the script re-invokes itself with ``--worker``); variants alternate over ``--repeats`` rounds.
A last subprocess holds both optimizers and alternates their steps, for a time ratio that
load drift on a shared machine affects alike.

Per run: peak growth of RssAnon (from /proc/self/status, sampled every 2 ms in a thread)
above the baseline taken once parameters and gradients exist; the first step (it allocates
the state) and the median of the later steps. Target: ``disk`` keeps RssAnon growth <= 10%
of the state bytes at <= 1.5x the step time of ``memory`` (median of per-round ratios).

``--cap-gib`` (default: 0.9 x the state) then runs both variants once more inside a memory
cgroup (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``) capped below the state size:
``memory`` is expected to be OOM-killed, ``disk`` to complete (its pages are page cache,
written back and reclaimed under the cap). ``ulimit -v`` cannot show this: a mapping counts
towards the address-space limit exactly like anonymous memory. Needs a writable cgroup
hierarchy (root); otherwise the cap runs are reported as not possible.

Run: ``.venv/bin/python benchmarks/optimizer_offload.py`` (5-8 minutes on 2 CPU cores).
``--disk-dir`` must be on a real disk (tmpfs is refused); the default is the system temp
directory when that is not tmpfs, else ``./.bench-offload``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from furlong.train.filemap import MEMORY_FILESYSTEMS, filesystem_type  # noqa: E402
from furlong.train.optim import OptimizerConfig, build_optimizer, optimizer_step  # noqa: E402
from furlong.types import AdamParams  # noqa: E402

VARIANTS = ("memory", "disk")
MATRIX = (1024, 1024)  # fp32: 4 MiB per parameter
RSS_TARGET = 0.10  # disk RssAnon growth / state bytes
TIME_TARGET = 1.5  # disk step time / memory step time
GIB = 1 << 30
ADAM = AdamParams(learning_rate=1e-3, weight_decay=0.01)  # no clip: the gradient is shared


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler(threading.Thread):
    def __init__(self, period: float = 0.002):
        super().__init__(daemon=True)
        self.period, self.peak, self._done = period, rss_anon(), threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(self.period)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak, rss_anon())


def build(variant: str, state_gib: float, disk_dir: str):
    count = max(1, round(state_gib * GIB / 2 / (MATRIX[0] * MATRIX[1] * 4)))
    params = [torch.nn.Parameter(torch.randn(MATRIX)) for _ in range(count)]
    store = {"state_store": "disk", "disk_dir": disk_dir} if variant == "disk" else {}
    return params, build_optimizer(None, params, OptimizerConfig(**store))


def timed_step(params, optimizer, grad: torch.Tensor) -> float:
    grad.normal_()
    for p in params:
        p.grad = grad
    start = time.perf_counter()
    optimizer_step(params, optimizer, ADAM)
    return time.perf_counter() - start


def worker(variant: str, state_gib: float, steps: int, disk_dir: str, cgroup: str | None) -> dict:
    if cgroup:  # join the capped cgroup before allocating anything large
        Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
    torch.manual_seed(0)
    params, optimizer = build(variant, state_gib, disk_dir)
    grad = torch.empty(MATRIX)
    base = rss_anon()
    sampler = PeakSampler()
    sampler.start()
    times, faults = [], []
    for _ in range(steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        times.append(timed_step(params, optimizer, grad))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    peak = sampler.stop()
    state_bytes = sum(v.nbytes for s in optimizer.state.values() for v in s.values() if v.dim() > 0)
    file_backed = optimizer.store.file_backed_bytes(optimizer.parts)
    return {
        "variant": variant,
        "state_bytes": state_bytes,
        "file_backed_bytes": file_backed,
        "anon_growth": peak - base,
        "first_step_s": times[0],
        "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
        "minor_faults_per_step": statistics.median(faults[1:]) if len(faults) > 1 else faults[0],
    }


def interleaved(state_gib: float, steps: int, disk_dir: str) -> dict:
    """Both variants in one process, steps alternating: load drift hits both alike."""
    torch.manual_seed(0)
    built = {v: build(v, state_gib, disk_dir) for v in VARIANTS}
    grad = torch.empty(MATRIX)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(steps):
        for v in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
            times[v].append(timed_step(*built[v], grad))
    return {v: statistics.median(t[1:]) for v, t in times.items()}


def run_worker(args, variant: str, cgroup: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--state-gib", str(args.state_gib)]
    cmd += ["--steps", str(args.steps), "--disk-dir", args.disk_dir]
    if cgroup:
        cmd += ["--cgroup", cgroup]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"variant": variant, "returncode": proc.returncode, "stderr": proc.stderr[-400:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def make_cgroup(cap_bytes: int) -> tuple[str, str] | None:
    """A fresh memory cgroup capped at ``cap_bytes``: (path, kind) or None if not allowed."""
    name = f"furlong-offload-bench-{os.getpid()}-{time.monotonic_ns()}"
    for root, limit, kind in (
        ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "v1"),
        ("/sys/fs/cgroup", "memory.max", "v2"),
    ):
        path = Path(root, name)
        try:
            path.mkdir()
        except OSError:
            continue
        try:
            (path / limit).write_text(str(cap_bytes))
            swap = path / ("memory.memsw.limit_in_bytes" if kind == "v1" else "memory.swap.max")
            if swap.exists():  # no escape to swap
                swap.write_text(str(cap_bytes) if kind == "v1" else "0")
            return str(path), kind
        except OSError:
            path.rmdir()
    return None


def capped_runs(args, cap_bytes: int) -> list[dict]:
    results = []
    for variant in VARIANTS:
        made = make_cgroup(cap_bytes)
        if made is None:
            return []
        path, kind = made
        try:
            result = run_worker(args, variant, path) | {"cgroup": kind, "cap_bytes": cap_bytes}
            peak = Path(path, "memory.max_usage_in_bytes" if kind == "v1" else "memory.peak")
            if peak.exists():
                result["cgroup_peak_bytes"] = int(peak.read_text())
        finally:
            os.rmdir(path)
        results.append(result)
    return results


def default_disk_dir() -> str:
    tmp = tempfile.gettempdir()
    return tmp if filesystem_type(tmp) not in MEMORY_FILESYSTEMS else ".bench-offload"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--state-gib", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--disk-dir", default=None)
    parser.add_argument("--cap-gib", type=float, default=None, help="0: skip the capped runs")
    parser.add_argument("--worker", choices=(*VARIANTS, "interleaved"), help=argparse.SUPPRESS)
    parser.add_argument("--cgroup", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.disk_dir = args.disk_dir or default_disk_dir()
    if args.worker == "interleaved":
        print(json.dumps(interleaved(args.state_gib, args.steps, args.disk_dir)))
        return
    if args.worker:
        result = worker(args.worker, args.state_gib, args.steps, args.disk_dir, args.cgroup)
        print(json.dumps(result))
        return

    print(f"disk dir: {args.disk_dir} ({filesystem_type(args.disk_dir)})")
    rounds = []
    for r in range(args.repeats):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        rounds.append({v: run_worker(args, v) for v in order})
        for v in VARIANTS:
            if "returncode" in rounds[-1][v]:
                sys.exit(f"{v} failed: {rounds[-1][v]}")
    state = rounds[0]["memory"]["state_bytes"]
    print(f"\nstate {state / GIB:.2f} GiB, {args.steps} steps, {args.repeats} rounds")
    print(
        "| variant | RssAnon growth GiB | growth / state | first step s | step s (median) "
        "| minor faults / step |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for v in VARIANTS:
        growth = statistics.median(r[v]["anon_growth"] for r in rounds)
        first = statistics.median(r[v]["first_step_s"] for r in rounds)
        step = statistics.median(r[v]["step_s"] for r in rounds)
        faults = statistics.median(r[v]["minor_faults_per_step"] for r in rounds)
        print(
            f"| {v} | {growth / GIB:.3f} | {growth / state:.3f} | {first:.2f} | {step:.2f} "
            f"| {faults:,.0f} |"
        )
    ratios = [r["disk"]["step_s"] / r["memory"]["step_s"] for r in rounds]
    growth = max(r["disk"]["anon_growth"] for r in rounds) / state
    time_ratio = statistics.median(ratios)
    print(f"\ndisk/memory step time per round: {', '.join(f'{x:.2f}' for x in ratios)}")
    print(
        f"disk RssAnon growth {growth:.3f} of state (target <= {RSS_TARGET}); step time "
        f"{time_ratio:.2f}x (target <= {TIME_TARGET}x): "
        f"{'met' if growth <= RSS_TARGET and time_ratio <= TIME_TARGET else 'NOT met'}"
    )
    print(f"disk file-backed bytes: {rounds[0]['disk']['file_backed_bytes']}")
    both = run_worker(args, "interleaved")
    if "returncode" in both:
        sys.exit(f"interleaved run failed: {both}")
    print(
        f"one process, steps alternating: memory {both['memory']:.2f} s, disk "
        f"{both['disk']:.2f} s per step, ratio {both['disk'] / both['memory']:.2f}"
    )

    cap_gib = 0.9 * state / GIB if args.cap_gib is None else args.cap_gib
    if cap_gib > 0:
        capped = capped_runs(args, int(cap_gib * GIB))
        if not capped:
            print("\ncapped runs: not possible here (no writable memory cgroup)")
        for c in capped:
            if "returncode" not in c:
                outcome = f"completed, step {c['step_s']:.2f} s"
            else:
                why = "OOM-killed" if c["returncode"] == -9 else c["stderr"][-120:]
                outcome = f"failed (exit {c['returncode']}, {why})"
            peak = c.get("cgroup_peak_bytes")
            peak_text = f", cgroup peak {peak / GIB:.2f} GiB" if peak else ""
            print(f"cap {cap_gib:.2f} GiB ({c['cgroup']}): {c['variant']} {outcome}{peak_text}")


if __name__ == "__main__":
    main()
