"""Rollout throughput: the embedded engine (continuous batching) vs transformers `generate`.

32 requests with mixed ``max_tokens`` (8-128, seeded), sampling at temperature 1, no EOS stop,
on a tiny offline model. The baseline is one batched ``generate`` call (left padding,
``max_new_tokens`` = the longest request), which is what a static batch costs: short answers
wait for long ones. Useful tokens (each request's own ``max_tokens``) per second are compared;
candidate and baseline alternate over ``--repeats`` rounds and the median of per-round ratios
is reported. Target: >= 1.5x. The engine also runs with ``fast_forward=False`` (the HF forward
for every step) to show what continuous batching alone gives, and with FastForward on ATen's ops
only (``FURLONG_FUSED_KERNELS=0``) to show what the fused norm/rotary kernels give. Each side's
model-FLOPs utilisation is printed beside this machine's fp32 GEMM peak measured in the same run
(benchmarks/flops.py: the useful work, each request's own prompt and tokens; padding and
recomputation not counted), with the ceiling this workload's batch schedule allows: the MFU if
the run were its GEMMs alone (each step's projections and head at the step's batch size, timed
in isolation) and nothing else.

With ``--vllm auto`` the same run ends with vLLM's tokens/s beside the embedded engine's on
SmolLM2-135M (batch 32 and 64, 64 new tokens; benchmarks/vllm_rollout.py).

Run: ``.venv/bin/python benchmarks/rollout_throughput.py [--model small-qwen3] [--vllm auto]``
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))
from flops import Shape, decode_flops, gemm_peak  # noqa: E402

from furlong.models import load_model  # noqa: E402
from furlong.models.fused_kernels import fused_kernels, kernel_build  # noqa: E402
from furlong.rollout.engine import EmbeddedEngine  # noqa: E402
from furlong.rollout.sampling import SamplingParams  # noqa: E402


def workload(tokenizer, n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [
        tokenizer(f"Question {i}: what is {rng.randint(0, 99)} + {rng.randint(0, 99)}?")[
            "input_ids"
        ]
        for i in range(n)
    ]
    return prompts, [rng.randint(8, 128) for _ in range(n)]


def gemm_seconds(shape: Shape, prompts: list[list[int]], lengths: list[int]) -> float:
    """The workload's GEMMs alone: one left-padded prefill (the decoder over every position,
    the head over each row's last), then a decode step per drawn token with the rows still
    running, each linear timed in isolation at its batch size (best of 5)."""
    *layers, head = shape.linears()
    cache: dict[tuple[int, int, int], float] = {}

    def linear(rows: int, fan_in: int, fan_out: int) -> float:
        key = (rows, fan_in, fan_out)
        if key not in cache:
            x, w = torch.randn(rows, fan_in), torch.randn(fan_out, fan_in)
            F.linear(x, w)
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                F.linear(x, w)
                best = min(best, time.perf_counter() - start)
            cache[key] = best
        return cache[key]

    def step(rows: int, positions: int) -> float:
        body = sum(linear(rows * positions, a, b) for a, b in layers)
        return body + linear(rows, *head)

    total = step(len(prompts), max(map(len, prompts)))
    for t in range(1, max(lengths)):  # after t draws, the rows with more to go are fed
        total += step(sum(n > t for n in lengths), 1)
    return total


@contextmanager
def aten_ops_only() -> Iterator[None]:
    """FastForward without the fused kernels, as ``FURLONG_FUSED_KERNELS=0`` makes it."""
    before = os.environ.get("FURLONG_FUSED_KERNELS")
    os.environ["FURLONG_FUSED_KERNELS"] = "0"
    kernel_build.cache_clear()
    try:
        yield
    finally:
        if before is None:
            del os.environ["FURLONG_FUSED_KERNELS"]
        else:
            os.environ["FURLONG_FUSED_KERNELS"] = before
        kernel_build.cache_clear()


def run_engine(model, tokenizer, prompts, lengths, fast_forward: bool = True) -> float:
    engine = EmbeddedEngine(model, tokenizer, max_running=len(prompts), fast_forward=fast_forward)
    params = [
        SamplingParams(max_tokens=m, seed=i, stop_token_ids=()) for i, m in enumerate(lengths)
    ]
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(r.output_ids) for r in results] == lengths
    return sum(lengths) / elapsed


@torch.no_grad()
def run_generate(model, tokenizer, prompts, lengths) -> float:
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        max_new_tokens=max(lengths),
        min_new_tokens=max(lengths),
        pad_token_id=pad,
    )
    return sum(lengths) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vllm",
        metavar="PYTHON",
        help="also vLLM beside the embedded engine on SmolLM2-135M, batch 32 and 64, 64 new "
        "tokens (benchmarks/vllm_rollout.py; 'auto': make vllm-venv's Python)",
    )
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    model.eval()
    prompts, lengths = workload(tokenizer, args.requests, args.seed)
    shape = Shape.of(model.config)
    work = sum(decode_flops(shape, len(p), n) for p, n in zip(prompts, lengths, strict=True))
    peak = gemm_peak()
    ceiling = work / gemm_seconds(shape, prompts, lengths) / 1e9 / peak
    print(
        f"{args.model}: {args.requests} requests, max_tokens 8-128 (sum {sum(lengths)}), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{work / 1e9:.2f} model GFLOP, fp32 GEMM peak {peak:.1f} GFLOP/s; its GEMMs alone, "
        f"at each step's batch size: {100 * ceiling:.1f}% MFU"
    )

    def mfu(tokens_per_s: float) -> str:
        return f"{100 * work / (sum(lengths) / tokens_per_s) / 1e9 / peak:4.1f}% MFU"

    kernels = "fused kernels" if fused_kernels() is not None else "no fused kernels (ATen's ops)"
    print(f"engine: FastForward with {kernels}")
    run_engine(model, tokenizer, prompts[:2], [4, 4])  # warm-up
    rows = []
    for _ in range(args.repeats):
        ours = run_engine(model, tokenizer, prompts, lengths)
        with aten_ops_only():
            aten = run_engine(model, tokenizer, prompts, lengths)
        hf_steps = run_engine(model, tokenizer, prompts, lengths, fast_forward=False)
        base = run_generate(model, tokenizer, prompts, lengths)
        rows.append((ours / base, aten / base, hf_steps / base))
        print(
            f"engine {ours:7.1f} tok/s ({mfu(ours)})  ATen ops only {aten:7.1f} ({mfu(aten)})  "
            f"HF forward {hf_steps:7.1f} ({mfu(hf_steps)})  generate {base:7.1f} "
            f"({mfu(base)})  ratios {ours / base:.2f} / {aten / base:.2f} / {hf_steps / base:.2f}"
        )
    ratio, aten_ratio, alone = (statistics.median(r[i] for r in rows) for i in range(3))
    print(f"\ncontinuous batching with the HF forward alone: median ratio {alone:.2f}")
    gain = statistics.median(r[0] / r[1] for r in rows)
    print(f"ATen's ops only: median ratio {aten_ratio:.2f} (fused / ATen: {gain:.2f}x)")
    for target, issue in ((1.5, 3), (2.5, 27)):
        verdict = "PASS" if ratio >= target else "FAIL"
        print(f"{verdict}: median ratio {ratio:.2f} (target of issue {issue}: >= {target})")
    if args.vllm:
        from vllm_rollout import compare

        print("\nvLLM beside the embedded engine (issue 42):")
        compare(args.vllm, "smollm2-135m", [32, 64], 64, args.repeats, threads=1)


if __name__ == "__main__":
    main()
