"""CSR row helpers shared by the rollout's ``SamplingMask`` and the trainer's mask replay
(rows ``ids[offsets[t]:offsets[t + 1]]``)."""

from __future__ import annotations

import torch


def row_of(offsets: torch.Tensor) -> torch.Tensor:
    """The row index of every id: ``[offsets[-1]]`` int64."""
    lengths = (offsets[1:] - offsets[:-1]).to(torch.int64)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)


def row_contains(ids: torch.Tensor, offsets: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Bool ``[rows]``: does row ``t`` hold ``tokens[t]``? No dense ``[rows, V]`` matrix."""
    rows = row_of(offsets)
    hits = torch.zeros(offsets.numel() - 1, dtype=torch.int64, device=ids.device)
    hits.index_add_(0, rows, (ids.to(torch.int64) == tokens.to(torch.int64)[rows]).to(torch.int64))
    return hits > 0
