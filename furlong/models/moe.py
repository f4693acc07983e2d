"""MoE structure shared by recording (rollout) and replay (trainer)."""

from __future__ import annotations

import torch


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers (``mlp.gate`` returning ``(logits, scores, indices)``, as in
    transformers' Qwen3-MoE and Mixtral), in layer order."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
