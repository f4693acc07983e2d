"""The engine's optimizer (AdamW, or Muon for hidden matrices + AdamW for the rest), driven by
Tinker's AdamParams, with a global-norm clip and a non-finite veto.

Per-step hyper-parameters come from the request's AdamParams: AdamW takes all of them; Muon
takes ``learning_rate`` and ``weight_decay`` (decoupled, unadjusted lr, as torch) and keeps
its own momentum, nesterov and Newton–Schulz settings from :class:`OptimizerConfig`. With
``muon_adjust_lr="match_rms_adamw"`` (default) Muon scales its lr by 0.2·sqrt(max(rows, cols))
so that an lr tuned for AdamW fits (Moonshot, "Muon is Scalable for LLM Training").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from furlong.errors import InputError
from furlong.train.composite import CompositeOptimizer
from furlong.train.muon import NS_DTYPES, Muon
from furlong.train.offload import check_chunk_bytes, make_store
from furlong.types import AdamParams

KINDS = ("adamw", "muon")
STATE_STORES = ("memory", "disk")
ADJUST_LR = ("original", "match_rms_adamw")


@dataclass(frozen=True)
class OptimizerConfig:
    """Which optimizer the engine builds and where its state lives (fixed for an engine)."""

    kind: str = "adamw"  # "adamw" | "muon": Muon for hidden matrices, AdamW for the rest
    state_store: str = "memory"  # "memory" | "disk" (file-backed mappings, furlong.train.offload)
    disk_dir: str | None = None  # state_store "disk": a directory on a real disk, not tmpfs
    chunk_bytes: int = 256 << 20  # disk state on an accelerator streams this much at a time
    muon_momentum: float = 0.95  # Muon's momentum (beta); AdamParams' betas go to AdamW only
    muon_nesterov: bool = True  # Nesterov momentum for Muon
    muon_ns_steps: int = 5  # Newton-Schulz iterations per orthogonalization
    muon_ns_dtype: str = "auto"  # "auto": float32 on CPU (bf16 is emulated there), else bf16
    # match_rms_adamw: 0.2·lr·sqrt(max(rows, cols)); original: lr·sqrt(max(1, rows/cols))
    muon_adjust_lr: str = "match_rms_adamw"

    def __post_init__(self) -> None:
        _one_of("kind", self.kind, KINDS)
        _one_of("state_store", self.state_store, STATE_STORES)
        if self.state_store == "disk" and not self.disk_dir:
            raise InputError("optimizer.disk_dir: required for state_store 'disk'")
        check_chunk_bytes(self.chunk_bytes)
        momentum, steps = self.muon_momentum, self.muon_ns_steps
        if isinstance(momentum, bool) or not isinstance(momentum, int | float):
            raise InputError(f"optimizer.muon_momentum: expected a number, got {momentum!r}")
        if not 0 <= momentum < 1:
            raise InputError(f"optimizer.muon_momentum: must be in [0, 1), got {momentum}")
        if not isinstance(self.muon_nesterov, bool):
            raise InputError(
                f"optimizer.muon_nesterov: expected a bool, got {self.muon_nesterov!r}"
            )
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < 100:
            raise InputError(
                f"optimizer.muon_ns_steps: must be an integer in [1, 99], got {steps!r}"
            )
        _one_of("muon_ns_dtype", self.muon_ns_dtype, ("auto", *NS_DTYPES))
        _one_of("muon_adjust_lr", self.muon_adjust_lr, ADJUST_LR)


def _one_of(name: str, value: object, allowed: Sequence[str]) -> None:
    if value not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise InputError(f"optimizer.{name}: {value!r} is not one of {choices}")


def muon_params(
    model: torch.nn.Module | None,
    params: Sequence[torch.Tensor],
    stands_for: Sequence[torch.Tensor] | None = None,
) -> list:
    """The hidden matrices: 2-D parameters and 3-D ones (MoE experts, per matrix) outside the
    input embedding and the output head (and any adapter on them). Norms, biases, embeddings
    and the head stay with AdamW. ``stands_for[i]``: the model's parameter that ``params[i]``
    is the master of (default: itself)."""
    excluded: set[int] = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if module is not None:
            excluded |= {id(p) for p in module.parameters()}
    owners = params if stands_for is None else stands_for
    return [
        p
        for p, own in zip(params, owners, strict=True)
        if p.ndim in (2, 3) and id(own) not in excluded
    ]


def build_optimizer(
    model: torch.nn.Module | None,
    params: Sequence[torch.nn.Parameter],
    config: OptimizerConfig | None = None,
    stands_for: Sequence[torch.Tensor] | None = None,
) -> CompositeOptimizer:
    """The state store is set up first (a bad disk_dir fails before anything is built).
    ``stands_for``: see :func:`muon_params`."""
    config = config or OptimizerConfig()
    store = make_store(config.state_store, config.disk_dir, config.chunk_bytes)
    matrices = muon_params(model, params, stands_for) if config.kind == "muon" else []
    in_muon = {id(p) for p in matrices}
    rest = [p for p in params if id(p) not in in_muon]
    d = AdamParams()  # placeholders: apply_adam_params sets them before every step
    parts: list[torch.optim.Optimizer] = []
    if rest:
        parts.append(
            torch.optim.AdamW(
                [{"params": rest, "kind": "adamw"}],
                lr=d.learning_rate,
                betas=(d.beta1, d.beta2),
                eps=d.eps,
                weight_decay=0.0,
            )
        )
    if matrices:
        ns_dtype = config.muon_ns_dtype
        if ns_dtype == "auto":
            ns_dtype = "float32" if matrices[0].device.type == "cpu" else "bfloat16"
        parts.append(
            Muon(
                matrices,
                lr=d.learning_rate,
                weight_decay=0.0,
                momentum=config.muon_momentum,
                nesterov=config.muon_nesterov,
                ns_steps=config.muon_ns_steps,
                adjust_lr_fn=config.muon_adjust_lr,
                ns_dtype=ns_dtype,
            )
        )
    return CompositeOptimizer(config.kind, params, parts, store)


def apply_adam_params(
    optimizer: torch.optim.Optimizer | CompositeOptimizer, adam: AdamParams
) -> None:
    for group in optimizer.param_groups:
        group["lr"] = adam.learning_rate
        group["weight_decay"] = adam.weight_decay
        if group.get("kind", "adamw") == "adamw":  # Muon's eps is Newton–Schulz's, not Adam's
            group["betas"] = (adam.beta1, adam.beta2)
            group["eps"] = adam.eps


def global_grad_norm(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0)


def optimizer_step(
    params: Sequence[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer | CompositeOptimizer,
    adam: AdamParams,
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
