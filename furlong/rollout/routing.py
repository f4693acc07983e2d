"""Recording which experts each position was routed to, for MoE routing replay (R3).

A forward hook on every top-k router (``mlp.gate`` returning ``(logits, scores, indices)``,
as transformers' Qwen3-MoE and Mixtral routers do) captures the chosen expert indices of one
forward pass, flattened over ``[batch, positions]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from furlong.models.moe import find_routers


class RoutingRecorder:
    """Collects one ``[rows, top_k]`` int32 tensor per router layer during :meth:`record`."""

    def __init__(self, model: torch.nn.Module):
        self.routers = find_routers(model)
        self.layers: list[torch.Tensor] = []

    @property
    def is_moe(self) -> bool:
        return bool(self.routers)

    @contextmanager
    def record(self, enabled: bool = True) -> Iterator[RoutingRecorder]:
        """Record the routers' choices during the block (nothing when ``enabled`` is False)."""
        self.layers = [torch.empty(0)] * len(self.routers)
        if not enabled:
            yield self
            return

        def hook(index: int) -> Callable[[torch.nn.Module, Any, Any], None]:
            def save(_module: torch.nn.Module, _inputs: Any, outputs: Any) -> None:
                self.layers[index] = outputs[2].detach().to(torch.int32)

            return save

        handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(self.routers)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def rows(self, batch: int) -> torch.Tensor:
        """``[batch, positions, layers, top_k]`` from the last recorded pass."""
        stacked = torch.stack(self.layers, dim=1)  # [batch * positions, layers, top_k]
        return stacked.view(batch, -1, *stacked.shape[1:])
