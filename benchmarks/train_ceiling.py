"""How close a training pass runs to what its GEMM and attention kernels allow: the pass's
model GFLOP/s against (a) the machine's fp32 GEMM peak (benchmarks/flops.py, 1024² matmul) and
(b) its kernels-alone ceiling, measured in the same run.

The ceiling: one ``forward_backward`` is recorded (torch.profiler, shapes only); every GEMM
(``mm``/``addmm``) and SDPA forward/backward call in it is then timed alone, on fresh random
tensors of the same shapes, and the times are summed. That sum is what the pass would take if
everything else (norms, activations, copies, Python) cost nothing and each kernel ran as fast
as it does alone: model FLOPs / that sum is the highest model GFLOP/s these kernels can give.
The pass's own time is measured without the profiler (it inflates memory-bound ops several
times over).

Workload (issue 27's): small-qwen3, 64 datums x 512 random tokens, cross_entropy, a LoRA
adapter of rank 32 on every linear as the Tinker service builds it (``--rank 0``: full
fine-tuning), fp32, with the host heap set as the service sets it
(:func:`furlong.host_memory.keep_freed_blocks`: no page faults on reused activations).

Run: ``.venv/bin/python benchmarks/train_ceiling.py [--rounds 3] [--threads 2]``
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flops import Shape, gemm_peak, train_flops  # noqa: E402
from torch.profiler import profile  # noqa: E402

from furlong.host_memory import keep_freed_blocks  # noqa: E402
from furlong.models.loading import load_model  # noqa: E402
from furlong.train import lora  # noqa: E402
from furlong.train.api import LossCall  # noqa: E402
from furlong.train.engine import TrainingEngine  # noqa: E402
from furlong.types import Datum  # noqa: E402

SDPA = "aten::_scaled_dot_product_flash_attention_for_cpu"


def engine(model_name: str, rank: int) -> TrainingEngine:
    model, tokenizer = load_model(model_name, seed=0)
    if rank == 0:
        return TrainingEngine(model, tokenizer)
    model.requires_grad_(False)
    spec = lora.LoraSpec(rank=rank)
    peft = lora.add_adapter(None, model, "bench", lora.peft_config(model, spec), seed=0)
    return TrainingEngine(peft, tokenizer, trainable=lora.adapter_params(peft, "bench"))


def workload(rows: int, length: int, vocab: int) -> LossCall:
    g = torch.Generator().manual_seed(0)
    datums = []
    for _ in range(rows):
        t = torch.randint(1, vocab, (length + 1,), generator=g)
        datums.append(Datum(t[:-1], {"target_tokens": t[1:], "weights": torch.ones(length)}))
    return LossCall(datums, "cross_entropy", backward=True)


def timed(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()  # first call: allocation, packing
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def kernel_calls(eng: TrainingEngine, call: LossCall) -> collections.Counter:
    """(kind, shapes) -> calls in one pass: GEMMs as (m, k, n), SDPA by q and k shapes."""
    with profile(record_shapes=True) as prof:
        eng.run_loss(call)
    eng.zero_grad()
    calls: collections.Counter = collections.Counter()
    for e in prof.events():
        shapes = e.input_shapes
        if e.name in ("aten::mm", "aten::addmm", "aten::addmm_") and shapes:
            a, b = (shapes[0], shapes[1]) if e.name == "aten::mm" else (shapes[1], shapes[2])
            calls["gemm", (a[0], a[1], b[1])] += 1
        elif e.name in (SDPA, SDPA + "_backward") and shapes:
            forward = e.name == SDPA  # the backward's first input is the output's gradient
            q, k = (shapes[0], shapes[1]) if forward else (shapes[1], shapes[2])
            calls["sdpa forward" if forward else "sdpa backward", (tuple(q), tuple(k))] += 1
    return calls


def alone(kind: str, shape: tuple) -> float:
    """Seconds for one call of this kernel on fresh tensors."""
    if kind == "gemm":
        m, k, n = shape
        a, b = torch.randn(m, k), torch.randn(k, n)
        return timed(lambda: a @ b)
    q_shape, k_shape = shape
    q = torch.randn(q_shape, requires_grad=True)
    k = torch.randn(k_shape, requires_grad=True)
    v = torch.randn(k_shape, requires_grad=True)
    gqa = q_shape[1] != k_shape[1]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if kind == "sdpa forward":
        with torch.no_grad():
            return timed(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            )
    grad = torch.randn_like(out)
    return timed(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="small-qwen3")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank; 0: full fine-tuning")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_blocks()

    eng = engine(args.model, args.rank)
    config = eng.model.config
    call = workload(args.rows, args.length, config.vocab_size)
    flops = train_flops(Shape.of(config), [args.length] * args.rows, args.rank or None)
    peak = gemm_peak()
    print(
        f"{args.model} {args.rows}x{args.length}, LoRA rank {args.rank or '- (full)'}, "
        f"{args.threads} threads: {flops / 1e9:.0f} model GFLOP a pass"
    )
    print(f"fp32 GEMM peak (1024²): {peak:.1f} GFLOP/s")

    eng.run_loss(call)  # warm-up
    eng.zero_grad()
    passes = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        eng.run_loss(call)
        passes.append(time.perf_counter() - start)
        eng.zero_grad()

    ceiling_s = 0.0
    by_kind: collections.Counter = collections.Counter()
    for (kind, shape), count in sorted(kernel_calls(eng, call).items(), key=str):
        seconds = alone(kind, shape) * count
        ceiling_s += seconds
        by_kind[kind] += seconds
        print(f"  {kind} {shape} x{count}: {1e3 * seconds / count:.2f} ms a call alone")
    peak = max(peak, gemm_peak())  # the better of before and after

    median = statistics.median(passes)
    achieved = flops / median / 1e9
    ceiling = flops / ceiling_s / 1e9
    print()
    print(
        "kernels alone: "
        + ", ".join(f"{k} {v:.3f} s" for k, v in by_kind.items())
        + f"; total {ceiling_s:.3f} s"
    )
    print(f"pass: median {median:.3f} s (rounds: {', '.join(f'{p:.3f}' for p in passes)})")
    print(f"achieved {achieved:.1f} model GFLOP/s = {100 * achieved / peak:.0f}% of the peak")
    print(
        f"ceiling  {ceiling:.1f} model GFLOP/s = {100 * ceiling / peak:.0f}% of the peak "
        f"(kernels alone)"
    )
    print(f"achieved / ceiling: {achieved / ceiling:.2f}")


if __name__ == "__main__":
    main()
