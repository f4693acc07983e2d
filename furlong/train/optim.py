"""AdamW with Tinker's AdamParams, a global-norm clip and a non-finite veto."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from furlong.types import AdamParams


def build_adamw(params: Sequence[torch.nn.Parameter]) -> torch.optim.AdamW:
    # Hyper-parameters are overwritten from the request's AdamParams before every step.
    d = AdamParams()
    return torch.optim.AdamW(
        params, lr=d.learning_rate, betas=(d.beta1, d.beta2), eps=d.eps, weight_decay=0.0
    )


def apply_adam_params(optimizer: torch.optim.Optimizer, adam: AdamParams) -> None:
    for group in optimizer.param_groups:
        group["lr"] = adam.learning_rate
        group["betas"] = (adam.beta1, adam.beta2)
        group["eps"] = adam.eps
        group["weight_decay"] = adam.weight_decay


def global_grad_norm(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0)


def optimizer_step(
    params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer, adam: AdamParams
) -> dict[str, float]:
    """One step; gradients are zeroed afterwards whether or not the step ran.

    A NaN/inf gradient norm vetoes the update (the optimizer's step count does not advance)
    and is reported as ``skipped_nonfinite:sum``.
    """
    total_norm = global_grad_norm(params)
    norm = float(total_norm)
    metrics = {"grad_norm:mean": norm, "learning_rate:mean": adam.learning_rate}
    if not math.isfinite(norm):
        metrics["skipped_nonfinite:sum"] = 1.0
    else:
        metrics["skipped_nonfinite:sum"] = 0.0
        if adam.grad_clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, adam.grad_clip_norm, total_norm)
        apply_adam_params(optimizer, adam)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return metrics
