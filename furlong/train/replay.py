"""Sampling-mask replay inputs for the TrainingEngine: per-datum kept sets as row supports.

A mask is anything with ``tensors() -> (ids, offsets)`` (``furlong.rollout.SamplingMask``)
or an ``(ids, offsets)`` pair; ``train`` does not import ``rollout``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import torch

from furlong.errors import InputError
from furlong.train.logprobs import RowSupports, check_targets_in_support
from furlong.types import Datum


def _csr(mask: Any, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, offsets = mask.tensors() if hasattr(mask, "tensors") else mask
    ids, offsets = torch.as_tensor(ids), torch.as_tensor(offsets)
    if ids.dim() != 1 or offsets.dim() != 1 or offsets.numel() < 1:
        raise InputError(f"sampling_masks[{i}]: expected CSR (ids, offsets) tensors")
    return ids.to(torch.int64), offsets.to(torch.int64)


@overload
def row_supports(datums: Sequence[Datum], masks: Sequence[Any]) -> list[RowSupports]: ...
@overload
def row_supports(
    datums: Sequence[Datum], masks: Sequence[Any] | None
) -> list[RowSupports] | None: ...
def row_supports(datums: Sequence[Datum], masks: Sequence[Any] | None) -> list[RowSupports] | None:
    """One RowSupports per datum (all rows of the datum), validated; None when no replay."""
    if masks is None:
        return None
    if len(masks) != len(datums):
        raise InputError(f"sampling_masks: {len(masks)} masks for {len(datums)} datums")
    out = []
    for i, (d, mask) in enumerate(zip(datums, masks, strict=True)):
        rows = len(d)
        if mask is None:
            out.append(
                RowSupports(
                    torch.zeros(rows, dtype=torch.bool),
                    torch.zeros(0, dtype=torch.int64),
                    torch.zeros(rows + 1, dtype=torch.int64),
                )
            )
            continue
        ids, offsets = _csr(mask, i)
        n = offsets.numel() - 1
        targets = d.loss_fn_inputs["target_tokens"]
        if n > rows or targets.dim() != 1:
            raise InputError(
                f"sampling_masks[{i}]: {n} positions for a datum of {rows} 1-D targets"
            )
        try:
            check_targets_in_support(targets[rows - n :], ids, offsets)
        except InputError as exc:
            raise InputError(f"sampling_masks[{i}]: {exc}") from None
        masked = torch.arange(rows) >= rows - n
        full_offsets = torch.cat([torch.zeros(rows - n, dtype=torch.int64), offsets])
        out.append(RowSupports(masked, ids, full_offsets))
    return out


def concat_supports(parts: Sequence[RowSupports]) -> RowSupports:
    """Row supports of datums laid end to end (the microbatch's row order)."""
    offsets, base = [torch.zeros(1, dtype=torch.int64)], 0
    for p in parts:
        offsets.append(p.offsets[1:] + base)
        base += p.ids.numel()
    return RowSupports(
        torch.cat([p.masked for p in parts]),
        torch.cat([p.ids for p in parts]),
        torch.cat(offsets),
    )
