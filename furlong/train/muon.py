"""Muon for hidden matrices: torch.optim.Muon's update applied per matrix, with an FP32 option.

- A 2-D parameter is one matrix; a 3-D parameter (MoE experts, ``[E, rows, cols]``) is E
  independent matrices, each with its own Newton–Schulz and its own learning-rate adjustment.
- ``ns_dtype="bfloat16"`` runs torch.optim.Muon's own update function, so on 2-D parameters
  this optimizer *is* torch.optim.Muon (bit-identical, tested). ``"float32"`` runs the same
  math with the Newton–Schulz iteration in fp32: on CPUs without native bf16 (AVX2) bf16
  matmuls are emulated and ~160x slower. The two agree to bf16 rounding (see the tests).

State per parameter: ``{"momentum_buffer"}`` with the parameter's shape, as torch's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim import _muon as torch_muon  # torch.optim.Muon's update (no public functional)

NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
DEFAULT_NS_COEFFICIENTS = (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C)


def newton_schulz(
    g: torch.Tensor,
    coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    steps: int = torch_muon.DEFAULT_NS_STEPS,
    eps: float = torch_muon.EPS,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton–Schulz orthogonalisation of a matrix, run in ``dtype``
    (bfloat16: torch's own function)."""
    if dtype == torch.bfloat16:
        return torch_muon._zeropower_via_newtonschulz(g, coefficients, steps, eps)
    a, b, c = coefficients
    x = g.to(dtype, copy=True)  # copy: without nesterov ``g`` is the momentum buffer itself
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def _step_fp32(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    bufs: list[torch.Tensor],
    group: dict,
) -> None:
    """torch.optim._muon._single_tensor_muon with the Newton–Schulz in fp32."""
    lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
    for p, g, buf in zip(params, grads, bufs, strict=True):
        buf.lerp_(g, 1 - momentum)
        update = g.lerp(buf, momentum) if group["nesterov"] else buf
        update = newton_schulz(
            update, tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"]
        )
        p.mul_(1 - lr * wd)  # decoupled weight decay with the unadjusted lr, as torch
        p.add_(update, alpha=-torch_muon._adjust_lr(lr, group["adjust_lr_fn"], p.shape))


class Muon(torch.optim.Optimizer):
    """Muon (torch.optim.Muon's defaults and update) over 2-D and 3-D (per-matrix) parameters.

    Param groups carry ``kind: "muon"`` so hyper-parameter plumbing can tell them from AdamW's.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = torch_muon.EPS,
        ns_steps: int = torch_muon.DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        ns_dtype: str = "bfloat16",
    ) -> None:
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1:
            raise ValueError("Muon: lr and weight_decay must be >= 0 and momentum in [0, 1)")
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"Muon: ns_dtype must be one of {sorted(NS_DTYPES)}")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"Muon: adjust_lr_fn must be one of {ADJUST_LR_FNS}")
        defaults = {
            "kind": "muon",
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_dtype": ns_dtype,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(f"Muon: parameters must be 2-D or 3-D, got {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(
                        p.grad, memory_format=torch.preserve_format
                    )
                buf = state["momentum_buffer"]
                if p.ndim == 2:
                    params.append(p)
                    grads.append(p.grad)
                    bufs.append(buf)
                else:  # views: in-place updates of one expert's matrix land in the 3-D tensor
                    params.extend(p.unbind(0))
                    grads.extend(p.grad.unbind(0))
                    bufs.extend(buf.unbind(0))
            if not params:
                continue
            if group["ns_dtype"] == "bfloat16":
                torch_muon.muon(
                    params,
                    grads,
                    bufs,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    momentum=group["momentum"],
                    nesterov=group["nesterov"],
                    ns_coefficients=tuple(group["ns_coefficients"]),
                    ns_steps=group["ns_steps"],
                    eps=group["eps"],
                    adjust_lr_fn=group["adjust_lr_fn"],
                    has_complex=False,
                )
            else:
                _step_fp32(params, grads, bufs, group)
        return loss
