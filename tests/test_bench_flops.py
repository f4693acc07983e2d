"""benchmarks/flops.py, the FLOP count behind every MFU in BENCHMARKS.md: hand-derived values on
a shape small enough to add up, and the linear part against torch's own FLOP counter."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from flops import Shape, attention_flops, decode_flops, train_flops  # noqa: E402

# 1 layer, hidden 2, 1 head of dim 2, MLP 3, vocab 5: q k v o 2x2 (16), gate up 2x3, down 3x2
# (18), head 2x5 (10): 44 weights; a LoRA of rank 1 adds sum(in + out) = 16 + 15 + 7 = 38
SHAPE = Shape(layers=1, hidden=2, heads=1, kv_heads=1, head_dim=2, intermediate=3, vocab=5)


def test_hand_counted() -> None:
    assert sum(a * b for a, b in SHAPE.linears()) == 44
    assert attention_flops(SHAPE, [2]) == 4 * 2 * (1 + 2)  # 24: contexts 1 and 2
    assert attention_flops(SHAPE, [3], new=1) == 4 * 2 * 3
    assert train_flops(SHAPE, [2]) == 3 * 2 * 44 * 2 + 3 * 24  # 600
    # LoRA: no first-layer input gradient through q, k, v (2x2 each) and their A (2x1 each)
    no_input_grad = 2 * 2 * (3 * 2 * 2 + 3 * 2 * 1)
    lora = 2 * 2 * 44 * 2 + 3 * 2 * 38 * 2 - no_input_grad + 3 * 24
    assert train_flops(SHAPE, [2], lora_rank=1) == lora
    # 2 prompt tokens, 2 new: the decoder runs on 3 positions (the last new token is never fed
    # back), the head on 2 (each sampled token's logits)
    assert decode_flops(SHAPE, prompt=2, new=2, batch=3) == 3 * (
        2 * 34 * 3 + 2 * 10 * 2 + 4 * 2 * 6
    )


def test_linears_match_torch_flop_counter() -> None:
    """Forward and backward through the shape's linears, chained, full fine-tuning: torch's
    counter sees every GEMM the count above names (attention left out of both)."""
    shape = Shape(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=12, vocab=9)
    tokens = 5
    weights = [torch.randn(b, a, requires_grad=True) for a, b in shape.linears()]
    x = torch.randn(tokens, shape.hidden, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        total = x.new_zeros(())
        for w in weights:  # each linear on an input of its width: the GEMMs a pass runs
            total = total + (torch.randn(tokens, w.shape[1]) @ w.T).sum()
        total.backward()
    full = train_flops(shape, [tokens]) - 3 * attention_flops(shape, [tokens])
    # the inputs are constants here: no input-gradient GEMM, so torch counts forward + weight grad
    assert counter.get_total_flops() == full * 2 / 3
