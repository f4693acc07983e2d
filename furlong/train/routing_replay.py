"""MoE routing replay (R3) in the trainer: score a sequence with the experts the rollout used.

Each top-k router's choice is forced to the recorded expert ids; the routing weights are
still computed from the router's own logits (softmax over all experts, gathered at the forced
ids, renormalized when the router normalizes its top-k), so gradients keep reaching the router
weights. Positions without a recorded row (padding, or datums sent without routing) keep the
router's own choice.

Routing for a datum is an int tensor ``[len(datum), layers, top_k]``: one row per input
position, as the rollout engine returns it for ``prompt + output[:-1]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from furlong.errors import InputError
from furlong.models.moe import find_routers
from furlong.types import Datum

UNSET = -1  # a position whose experts the router chooses itself


def check_routing(
    model: torch.nn.Module, datums: Sequence[Datum], routing: Sequence[Any] | None
) -> list[torch.Tensor | None] | None:
    """Validate ``routing`` (one entry per datum, each a tensor or None) before any compute."""
    if routing is None:
        return None
    routers = find_routers(model)
    if not routers:
        raise InputError("routed_experts: the model has no MoE routers")
    if len(routing) != len(datums):
        raise InputError(f"routed_experts: {len(routing)} entries for {len(datums)} datums")
    router: Any = routers[0]  # an HF TopKRouter; torch types module attributes Tensor | Module
    layers, top_k = len(routers), router.top_k
    experts = router.num_experts
    checked: list[torch.Tensor | None] = []
    for i, (d, rows) in enumerate(zip(datums, routing, strict=True)):
        if rows is None:
            checked.append(None)
            continue
        rows = torch.as_tensor(rows)
        want = (len(d), layers, top_k)
        if tuple(rows.shape) != want:
            raise InputError(
                f"routed_experts[{i}]: shape {tuple(rows.shape)}, expected {want} "
                "(one row per input position, layer and expert slot)"
            )
        if rows.dtype.is_floating_point or rows.dtype == torch.bool:
            raise InputError(f"routed_experts[{i}]: expected integer expert ids, got {rows.dtype}")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= experts):
            raise InputError(f"routed_experts[{i}]: expert ids must be in [0, {experts})")
        if rows.numel() and (rows.sort(-1).values.diff(dim=-1) == 0).any():
            raise InputError(f"routed_experts[{i}]: an expert is repeated within one row")
        checked.append(rows.to(torch.int64))
    return checked if any(r is not None for r in checked) else None


def forced_rows(
    routing: Sequence[torch.Tensor | None], lengths: Sequence[int], width: int
) -> torch.Tensor | None:
    """``[len(routing) * width, layers, top_k]`` in the padded ``[B, T]`` layout the routers
    see, ``UNSET`` where nothing was recorded; None when no datum has routes."""
    sample = next((r for r in routing if r is not None), None)
    if sample is None:
        return None
    out = torch.full((len(routing), width, *sample.shape[1:]), UNSET, dtype=torch.int64)
    for j, (rows, n) in enumerate(zip(routing, lengths, strict=True)):
        if rows is not None:
            out[j, :n] = rows
    return out.view(-1, *sample.shape[1:])


@contextmanager
def replay_routing(model: torch.nn.Module, forced: torch.Tensor | None) -> Iterator[None]:
    """Force the routers of ``model`` to ``forced`` (``[rows, layers, top_k]``) in the block."""
    if forced is None:
        yield
        return
    handles = [
        router.register_forward_hook(_force(layer, forced))
        for layer, router in enumerate(find_routers(model))
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _force(layer: int, forced: torch.Tensor) -> Callable[[torch.nn.Module, Any, tuple], tuple]:
    def hook(module: torch.nn.Module, _inputs: Any, outputs: tuple) -> tuple:
        logits, _, own = outputs
        chosen = forced[:, layer].to(own.device)
        if chosen.shape != own.shape:
            raise RuntimeError(f"routing replay: {chosen.shape} rows for {own.shape} positions")
        indices = torch.where(chosen == UNSET, own, chosen)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        scores = probs.gather(-1, indices)
        if getattr(module, "norm_topk_prob", True):
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return logits, scores.to(logits.dtype), indices.to(own.dtype)

    return hook
