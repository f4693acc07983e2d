"""benchmarks/train_ceiling.py's accounting: the GEMMs it records from a real training pass add
up to exactly the model's linear FLOPs of benchmarks/flops.py (forward, input gradients, weight
gradients; with a frozen embedding, no first-layer input gradient), changed by what the merged
LoRA node builds and skips where it applies, and it finds one SDPA forward and one backward
per layer and microbatch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from flops import Shape, attention_flops, train_flops  # noqa: E402
from train_ceiling import engine, kernel_calls, workload  # noqa: E402

from furlong.models import lora_training  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def merged_lora_change(shape: Shape, tokens: int, rank: int) -> int:
    """FLOPs the merged LoRA node (furlong.models.lora_training) adds to a pass over
    ``tokens`` rows against peft's unmerged accounting of flops.train_flops, layer by layer:
    where it applies, ``W' = W + s B A`` is built forward (and again backward where the
    input's gradient is needed: not for the first layer's q, k, v, over the frozen
    embedding), and the products through B forward and through A backward are not run."""
    per_layer = shape.linears()[:-1]  # the head's adapter runs in the fused head
    per_layer = per_layer[: len(per_layer) // shape.layers]
    change = 0
    for layer in range(shape.layers):
        for j, (fan_in, fan_out) in enumerate(per_layer):
            if tokens * (fan_in + fan_out) <= 2 * fan_in * fan_out:  # lora_training.applies
                continue
            change += 2 * fan_out * rank * fan_in - 2 * tokens * rank * fan_out
            if layer > 0 or j >= 3:  # the input's gradient: W' again, no product through A
                change += 2 * fan_out * rank * fan_in - 2 * tokens * rank * fan_in
    return change


@pytest.mark.parametrize(
    "rank, length, merged",
    [(0, 16, 0), (4, 16, 2), (4, 40, 7)],
    ids=["full", "lora-48-rows", "lora-120-rows"],
)
def test_recorded_kernels_cover_the_model_flops(
    rank: int, length: int, merged: int, monkeypatch
) -> None:
    """Full fine-tuning, and LoRA where the merged node takes k and v alone (48 rows: they pay
    from 43) or all 7 linears (120 rows: the MLP's pay from 96) of each layer."""
    taken = []
    real = lora_training.merged_lora_linear
    monkeypatch.setattr(lora_training, "merged_lora_linear", lambda *a: taken.append(1) or real(*a))
    eng = engine("tiny-qwen3", rank)
    config = eng.model.config
    rows = 3
    calls = kernel_calls(eng, workload(rows, length, config.vocab_size))
    gemms = {shape: c for (kind, shape), c in calls.items() if kind == "gemm"}
    recorded = sum(2 * m * k * n * c for (m, k, n), c in gemms.items())
    shape, lengths = Shape.of(config), [length] * rows
    linear = train_flops(shape, lengths, rank or None) - 3 * attention_flops(shape, lengths)
    change = merged_lora_change(shape, rows * length, rank) if rank else 0
    assert len(taken) == merged * config.num_hidden_layers
    assert recorded == linear + change > 0  # every GEMM recorded once: no recompute here
    if merged == 7:
        assert change < 0  # the merged pass does less work than peft's
    layers = config.num_hidden_layers
    sdpa = {kind: c for (kind, _), c in calls.items() if kind != "gemm"}
    assert sdpa == {"sdpa forward": layers, "sdpa backward": layers}
