"""A LoRA linear's training pass as one autograd node over the merged weight.

peft computes ``x @ W.T + s * (x @ A.T) @ B.T``: five GEMMs a training pass (the base's forward
and input gradient, ``x @ A.T`` and its product with ``B`` forward, and the way back through
both), plus an add of the two input gradients. With the base frozen, ``W' = W + s * B @ A``
([out, in], a rank-r update) gives the output and the input gradient in one GEMM each, so only
the adapter's own gradients need the rank-r products:

- forward: ``y = x @ W'.T (+ bias)``;
- backward: ``dx = dy @ W'``, ``dA = s * (dy @ B).T @ x``, ``dB = s * dy.T @ (x @ A.T)``.

The same sums in another order (fp32 rounding apart: ~1e-7 of the output's scale). ``W'`` is
built again in the backward, not kept, so the pass holds one layer's at a time. On small-qwen3
(64 x 512 tokens, rank 32, fp32) a linear's forward and backward go from 11-57 ms to 7-36 ms
(``benchmarks/train_ceiling.py`` shows the pass). Applies where the adapter and the base share a
dtype, nothing of the base trains and the pass has rows enough for building ``W'`` to pay
(:func:`applies`); a bf16 base with peft's fp32 adapters keeps the unmerged path, as merging
would round the adapter's update into bf16.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class _MergedLoraFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        # W' is rebuilt in the backward rather than kept: kept, every layer's would stay alive
        # until then, a second copy of the base's weights
        ctx.save_for_backward(x, weight, lora_a, lora_b)
        ctx.scaling = scaling
        return F.linear(x, torch.addmm(weight, lora_b, lora_a, alpha=scaling), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, lora_a, lora_b = ctx.saved_tensors
        need_x, _, _, need_a, need_b, _ = ctx.needs_input_grad
        dy = grad.reshape(-1, grad.shape[-1])
        rows = x.reshape(-1, x.shape[-1])
        dx = None
        if need_x:
            merged = torch.addmm(weight, lora_b, lora_a, alpha=ctx.scaling)
            dx = torch.mm(dy, merged).view(x.shape)
        da = torch.mm(torch.mm(dy, lora_b).t(), rows).mul_(ctx.scaling) if need_a else None
        db = torch.mm(dy.t(), torch.mm(rows, lora_a.t())).mul_(ctx.scaling) if need_b else None
        return dx, None, None, da, db, None


def applies(
    rows: int,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
) -> bool:
    """The merged node gives this layer's gradients (a frozen base, weight and bias, in the
    adapter's dtype) with fewer FLOPs for ``rows`` input rows: building ``W'`` twice costs
    ``2 * out * in * r`` multiply-adds and saves the ``rows * r * (in + out)`` of peft's two
    products through ``B`` and ``A``, so it pays from ``2 * in * out / (in + out)`` rows (384
    for a 256 x 768 projection, 4096 for 4096 x 4096)."""
    frozen = not weight.requires_grad and (bias is None or not bias.requires_grad)
    out_features, in_features = weight.shape
    pays = rows * (in_features + out_features) > 2 * in_features * out_features
    return frozen and pays and weight.dtype == lora_a.dtype == lora_b.dtype


def merged_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``F.linear(x, weight, bias) + scaling * F.linear(F.linear(x, lora_a), lora_b)`` as one
    node (:func:`applies` must hold)."""
    return _MergedLoraFn.apply(x, weight, bias, lora_a, lora_b, scaling)
