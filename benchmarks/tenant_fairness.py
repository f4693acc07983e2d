"""Tenant fairness: latency of tenant A's light request while tenant B's heavy job runs.

`furlong serve` runs in process on 127.0.0.1 (uvicorn in a background thread); both tenants
are official `tinker` SDK clients with different API keys. For each scenario, A's light
request is timed ``--repeats`` times with B idle ("alone") and ``--repeats`` times while B
keeps its heavy job re-submitted (``--depth`` in flight, so B is never idle: "under load").
Each round measures B's heavy job by itself first (what A would wait behind with a FIFO
queue, the old behaviour), then alone and under load in alternating order. Reported: p50 and
p95 of A's latency, the ratio p95(load) / p95(alone), B's job time alone and under A's
requests, and the compute lane's turns passed to another tenant.

1. sample: A samples 4 tokens from the base; B samples ``--samples`` x ``--sample-tokens``.
2. forward: A runs forward (1 datum x 16 tokens, cross_entropy) on its own LoRA model;
   B runs forward_backward (``--datums`` x ``--length`` tokens) on its own LoRA model.
3. sample vs train: A's 4-token sample while B's forward_backward runs.
4. forward vs RL steps: A's forward while B runs cookbook RL steps: save a sampler
   (``save_weights_and_get_sampling_client``) and sample ``--rl-samples`` x 16 tokens from it,
   which builds a snapshot engine every step.
5. sample vs RL steps: A's 4-token sample from the base while B runs those RL steps.

Run: ``.venv/bin/python benchmarks/tenant_fairness.py [--model tiny-qwen3 --repeats 16]``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
os.environ.setdefault("TINKER_TELEMETRY", "0")
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from furlong.server.app import create_app  # noqa: E402
from furlong.server.compute_lane import ComputeLane  # noqa: E402
from furlong.server.service import Service, ServiceConfig  # noqa: E402
from furlong.serving import background_server  # noqa: E402

BASE = "base"
PROMPT = types.ModelInput.from_ints([7, 8, 9, 10])
LIGHT_SAMPLE = types.SamplingParams(max_tokens=4, seed=0, stop=[])


@dataclass
class Scenario:
    name: str
    light: Callable[[], Any]  # blocks until A's result is back
    heavy: Callable[[], Any]  # submits one of B's jobs, returns its future
    alone: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    heavy_alone: list[float] = field(default_factory=list)
    heavy_load: list[float] = field(default_factory=list)
    turns: int = 0
    overlapped: int = 0  # A's requests under load that started and ended while B was busy


class HeavyLoop:
    """B's job re-submitted ``depth`` deep until stopped (bounded by ``max_jobs``/``deadline``)."""

    def __init__(self, submit: Callable[[], Any], depth: int, max_jobs: int, deadline: float):
        self.submit, self.depth, self.max_jobs = submit, depth, max_jobs
        self.deadline = time.monotonic() + deadline
        self.stop = threading.Event()
        self.started = threading.Event()
        self.durations: list[float] = []  # from the later of submit and previous end, to end
        self.in_flight = 0
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HeavyLoop:
        self.thread.start()
        self.started.wait(60)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=600)

    def busy(self) -> bool:
        return self.in_flight > 0 and self.thread.is_alive()

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 - reported by measure_load
            self.error = exc
        finally:
            self.in_flight = 0
            self.started.set()

    def _loop(self) -> None:
        pending: deque[tuple[float, Any]] = deque()
        submitted, last_end = 0, time.perf_counter()
        while pending or not self._done(submitted):
            while len(pending) < self.depth and not self._done(submitted):
                pending.append((time.perf_counter(), self.submit()))
                submitted += 1
                self.in_flight = len(pending)
                self.started.set()
            start, future = pending.popleft()
            future.result()
            end = time.perf_counter()
            self.durations.append(end - max(start, last_end))
            last_end = end
            self.in_flight = len(pending)

    def _done(self, submitted: int) -> bool:
        over = submitted >= self.max_jobs or time.monotonic() > self.deadline
        return self.stop.is_set() or over


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_alone(
    sc: Scenario, n: int, rng: np.random.Generator, args: argparse.Namespace, lane: ComputeLane
) -> None:
    for _ in range(n):
        time.sleep(rng.uniform(0, args.gap))
        sc.alone.append(timed(sc.light))


def measure_load(
    sc: Scenario, n: int, rng: np.random.Generator, args: argparse.Namespace, lane: ComputeLane
) -> None:
    turns = lane.turns_passed
    with HeavyLoop(sc.heavy, args.depth, args.max_jobs, args.deadline) as loop:
        time.sleep(args.settle)  # B's first job is under way
        for _ in range(n):
            # a random pause longer than one unit of B's work: A's arrivals are not locked to
            # B's microbatch or wave boundaries (A's previous request ended at one)
            time.sleep(rng.uniform(0, args.gap))
            before = loop.busy()
            sc.load.append(timed(sc.light))
            sc.overlapped += before and loop.busy()
    if loop.error is not None:
        raise RuntimeError(f"B's loop failed in {sc.name!r}") from loop.error
    sc.heavy_load.extend(loop.durations)  # every job of the load phase (the last drains alone)
    sc.turns += lane.turns_passed - turns


def run_round(
    sc: Scenario,
    n: int,
    load_first: bool,
    rng: np.random.Generator,
    args: argparse.Namespace,
    lane: ComputeLane,
) -> None:
    sc.heavy_alone.append(timed(lambda: sc.heavy().result()))
    steps = [measure_alone, measure_load]
    for step in reversed(steps) if load_first else steps:
        step(sc, n, rng, args, lane)
    print(f"  {sc.name}: round done, B's job alone {sc.heavy_alone[-1]:.2f} s", flush=True)


def datums(n: int, length: int, seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(3, 700, size=length + 1)
        inputs = {
            "target_tokens": tokens[1:].astype(np.int64),
            "weights": np.ones(length, np.float32),
        }
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                loss_fn_inputs={k: types.TensorData.from_numpy(v) for k, v in inputs.items()},
            )
        )
    return out


def scenarios(url: str, args: argparse.Namespace) -> list[Scenario]:
    a = tinker.ServiceClient(base_url=url, api_key="tml-a")
    b = tinker.ServiceClient(base_url=url, api_key="tml-b")
    a_sampler = a.create_sampling_client(base_model=BASE).result()
    b_sampler = b.create_sampling_client(base_model=BASE).result()
    a_train = a.create_lora_training_client(BASE, rank=8).result()
    b_train = b.create_lora_training_client(BASE, rank=8).result()
    light_batch, heavy_batch = datums(1, 16, 1), datums(args.datums, args.length, 2)
    big = types.SamplingParams(max_tokens=args.sample_tokens, seed=0, stop=[])

    def sample_light() -> Any:
        return a_sampler.sample(PROMPT, 1, LIGHT_SAMPLE).result()

    def forward_light() -> Any:
        return a_train.forward(light_batch, "cross_entropy").result()

    def sample_heavy() -> Any:
        return b_sampler.sample(PROMPT, args.samples, big)

    def train_heavy() -> Any:
        return b_train.forward_backward(heavy_batch, "cross_entropy")

    rl_params = types.SamplingParams(max_tokens=16, seed=0, stop=[])

    def rl_step() -> Any:
        sampler = b_train.save_weights_and_get_sampling_client().result()
        return sampler.sample(PROMPT, args.rl_samples, rl_params).result()

    steps = ThreadPoolExecutor(1, thread_name_prefix="tenant-b-rl")

    def rl_heavy() -> Any:
        return steps.submit(rl_step)

    for fn in (sample_light, forward_light):  # warm-up: tokenizer, sampler, adapters
        fn()
    b_train.forward_backward(heavy_batch[:1], "cross_entropy").result()
    return [
        Scenario("1 sample / sample", sample_light, sample_heavy),
        Scenario("2 forward / fwd_bwd", forward_light, train_heavy),
        Scenario("3 sample / fwd_bwd", sample_light, train_heavy),
        Scenario("4 forward / RL steps", forward_light, rl_heavy),
        Scenario("5 sample / RL steps", sample_light, rl_heavy),
    ]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


HEADER = (
    "| scenario (A / B) | A alone p50 / p95 ms | A under load p50 / p95 ms | p95 load / alone "
    "| A max under load ms | B's job alone s | B's job / A p95 load | B's job, load phase s "
    "| A overlapped B | turns passed |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def row(sc: Scenario) -> str:
    alone95, load95, job = pct(sc.alone, 95), pct(sc.load, 95), pct(sc.heavy_alone, 50)
    cells = [
        sc.name,
        f"{pct(sc.alone, 50) * 1e3:.0f} / {alone95 * 1e3:.0f}",
        f"{pct(sc.load, 50) * 1e3:.0f} / {load95 * 1e3:.0f}",
        f"{load95 / alone95:.1f}x",
        f"{max(sc.load) * 1e3:.0f}",
        f"{job:.2f}",
        f"{job / load95:.0f}x",
        f"{pct(sc.heavy_load, 50):.2f}",
        f"{sc.overlapped}/{len(sc.load)}",
        str(sc.turns),
    ]
    return "| " + " | ".join(cells) + " |"


def report(results: list[Scenario], args: argparse.Namespace) -> None:
    print(
        f"\n{args.model}, {args.threads} intra-op thread(s), {args.repeats} light requests per "
        f"condition; B: sample {args.samples} x {args.sample_tokens} tokens, fwd_bwd "
        f"{args.datums} x {args.length} tokens (microbatches of 8192 padded tokens)\n"
    )
    print(HEADER)
    for sc in results:
        print(row(sc))
    print(
        "\nB's job alone: median of one per round (a FIFO queue would make A wait up to this "
        "long, and for the queued next job too). Load phase: median interval between B's job "
        "completions while its loop ran (A's requests included)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--repeats", type=int, default=16, help="A's requests per condition")
    parser.add_argument("--rounds", type=int, default=2, help="alone/load alternations")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--samples", type=int, default=1024, help="B's num_samples")
    parser.add_argument("--sample-tokens", type=int, default=64, help="B's max_tokens")
    parser.add_argument("--datums", type=int, default=64, help="B's forward_backward datums")
    parser.add_argument("--length", type=int, default=1024, help="tokens per B datum")
    parser.add_argument("--rl-samples", type=int, default=8, help="B's samples per RL step")
    parser.add_argument("--depth", type=int, default=2, help="B's jobs kept in flight")
    parser.add_argument("--settle", type=float, default=0.5, help="s before A starts")
    parser.add_argument("--gap", type=float, default=1.0, help="max random pause before A's")
    parser.add_argument("--max-jobs", type=int, default=50, help="bound on B's loop")
    parser.add_argument("--deadline", type=float, default=300.0, help="bound on B's loop, s")
    parser.add_argument("--only", type=int, nargs="*", help="scenario numbers to run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    service = Service(ServiceConfig({BASE: args.model}, Path(tempfile.mkdtemp()) / "state"))
    per_round = -(-args.repeats // args.rounds)
    with background_server(create_app(service)) as url:
        chosen = [sc for i, sc in enumerate(scenarios(url, args), 1) if i in (args.only or [i])]
        for r in range(args.rounds):
            for sc in chosen:
                n = min(per_round, args.repeats - len(sc.alone))
                run_round(sc, n, r % 2 == 1, rng, args, service.lane)
        report(chosen, args)
    service.lane.shutdown()


if __name__ == "__main__":
    main()
