"""Autograd nodes over the fused training kernels (:mod:`furlong.models.fused_kernels`):
FastForward's training and scoring passes (:meth:`~furlong.models.fast_forward.FastForward.hidden`)
run their RMSNorms and the MLP's ``silu(g) * u`` through these when the kernels apply, with or
without grad, so a forward-only pass gives what ``forward_backward``'s forward gives.

Each forward is one pass over the activations and saves only its inputs (plus an RMSNorm's
per-row rstd): the product's ``silu(g)`` and the norm's fp32 ``x_hat`` are recomputed in the
backward's single pass instead of being kept. A norm whose weight does not train (a LoRA
base) still gets its ``dw`` summed: one multiply-add per element in the same pass.
"""

from __future__ import annotations

from typing import Any

import torch

from furlong.models.fused_kernels import FusedKernels


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, k: FusedKernels
    ) -> torch.Tensor:
        y, rstd = k.rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.kernels = k
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x, weight, rstd = ctx.saved_tensors
        dx, dw = ctx.kernels.rms_norm_bwd(grad.contiguous(), x, weight, rstd)
        return dx, dw.to(weight.dtype), None, None


class _SiluMulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, u: torch.Tensor, k: FusedKernels) -> torch.Tensor:
        ctx.save_for_backward(g, u)
        ctx.kernels = k
        return k.silu_mul_fwd(g, u)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        g, u = ctx.saved_tensors
        dg, du = ctx.kernels.silu_mul_bwd(grad.contiguous(), g, u)
        return dg, du, None


class _RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: FusedKernels
    ) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.kernels = k
        return k.rope(x, cos, sin)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        cos, sin = ctx.saved_tensors
        return ctx.kernels.rope(grad, cos, sin, backward=True), None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, k: FusedKernels) -> torch.Tensor:
    """HF's RMSNorm of dense ``x`` over its last dim (``weight`` in x's dtype)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFn.apply(x, weight, eps, k)
    return k.rms_norm_fwd(x, weight, eps)[0]


def silu_mul(g: torch.Tensor, u: torch.Tensor, k: FusedKernels) -> torch.Tensor:
    """``F.silu(g) * u`` for dense ``g`` and ``u`` of one shape and dtype."""
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        return _SiluMulFn.apply(g, u, k)
    return k.silu_mul_fwd(g, u)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: FusedKernels) -> torch.Tensor:
    """The rotary embedding ``x * cos + x.roll(hd // 2, -1) * sin`` of ``x [B, T, heads, hd]``
    (sign-folded ``sin``), bit for bit, forward and backward."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _RopeFn.apply(x, cos, sin, k)
    return k.rope(x, cos, sin)
