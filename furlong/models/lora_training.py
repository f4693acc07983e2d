"""A LoRA linear's training pass as one autograd node over the merged weight.

peft computes ``x @ W.T + s * (x @ A.T) @ B.T``: five GEMMs a training pass (the base's forward
and input gradient, ``x @ A.T`` and its product with ``B`` forward, and the way back through
both), plus an add of the two input gradients. With the base frozen, ``W' = W + s * B @ A``
([out, in], a rank-r update: negligible work) gives the output and the input gradient in one
GEMM each, so only the adapter's own gradients need the rank-r products:

- forward: ``y = x @ W'.T (+ bias)``;
- backward: ``dx = dy @ W'``, ``dA = s * (dy @ B).T @ x``, ``dB = s * dy.T @ (x @ A.T)``.

The same sums in another order (fp32 rounding apart: ~1e-7 of the output's scale). On small-qwen3
(64 x 512 tokens, rank 32, fp32) a linear's forward and backward go from 11-57 ms to 7-36 ms
(``benchmarks/train_ceiling.py`` shows the pass). Applies where the adapter and the base share a
dtype and nothing of the base trains; a bf16 base with peft's fp32 adapters keeps the unmerged
path, as merging would round the adapter's update into bf16.
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
        merged = torch.addmm(weight, lora_b, lora_a, alpha=scaling)
        ctx.save_for_backward(x, merged, lora_a, lora_b)
        ctx.scaling = scaling
        return F.linear(x, merged, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, merged, lora_a, lora_b = ctx.saved_tensors
        need_x, _, _, need_a, need_b, _ = ctx.needs_input_grad
        dy = grad.reshape(-1, grad.shape[-1])
        rows = x.reshape(-1, x.shape[-1])
        dx = torch.mm(dy, merged).view(x.shape) if need_x else None
        da = torch.mm(torch.mm(dy, lora_b).t(), rows).mul_(ctx.scaling) if need_a else None
        db = torch.mm(dy.t(), torch.mm(rows, lora_a.t())).mul_(ctx.scaling) if need_b else None
        return dx, None, None, da, db, None


def applies(
    weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor, lora_b: torch.Tensor
) -> bool:
    """The merged node gives this layer's gradients: a frozen base (weight and bias) in the
    adapter's dtype."""
    frozen = not weight.requires_grad and (bias is None or not bias.requires_grad)
    return frozen and weight.dtype == lora_a.dtype == lora_b.dtype


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
