"""benchmarks/train_ceiling.py's accounting: the GEMMs it records from a real training pass add
up to exactly the model's linear FLOPs of benchmarks/flops.py (forward, input gradients, weight
gradients; with a frozen embedding, no first-layer input gradient), and
it finds one SDPA forward and one backward per layer and microbatch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from flops import Shape, attention_flops, train_flops  # noqa: E402
from train_ceiling import engine, kernel_calls, workload  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("rank", [0, 4])
def test_recorded_kernels_cover_the_model_flops(rank: int) -> None:
    eng = engine("tiny-qwen3", rank)
    config = eng.model.config
    rows, length = 3, 16
    calls = kernel_calls(eng, workload(rows, length, config.vocab_size))
    gemms = {shape: c for (kind, shape), c in calls.items() if kind == "gemm"}
    recorded = sum(2 * m * k * n * c for (m, k, n), c in gemms.items())
    shape, lengths = Shape.of(config), [length] * rows
    linear = train_flops(shape, lengths, rank or None) - 3 * attention_flops(shape, lengths)
    assert recorded == linear > 0  # every model GEMM recorded once: no recompute here
    layers = config.num_hidden_layers
    sdpa = {kind: c for (kind, _), c in calls.items() if kind != "gemm"}
    assert sdpa == {"sdpa forward": layers, "sdpa backward": layers}
