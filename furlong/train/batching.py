"""Microbatches by a token budget, and the padded tensors one microbatch runs on.

The budget bounds ``rows x padded length`` of one forward pass; it never changes results,
because losses are raw sums and every datum's outputs are keyed by its request index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from furlong.types import Datum

PADDING = -1  # request index of a padding datum (mask m = 0): fills ranks or microbatches


def plan_microbatches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group datum indices so each group's ``len(group) * max_len <= token_budget``.

    Datums are taken longest first, which keeps padding low; a datum longer than the budget
    runs alone. ``token_budget <= 0`` puts everything in one microbatch.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if token_budget <= 0:
        return [order] if order else []
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= token_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass(frozen=True)
class Microbatch:
    """Padded inputs ``[B, T]`` plus the flat rows ``[R]`` that carry targets, in datum order."""

    indices: list[int]  # request index per datum slot, PADDING for padding datums
    input_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] int64
    rows: torch.Tensor  # [R] flat positions b * T + t of every real token
    segment: torch.Tensor  # [R] datum slot of each row
    targets: torch.Tensor  # [R] or [R, K] int64
    inputs: dict[str, torch.Tensor]  # per-token loss inputs, [R] or [R, K] fp32
    mask: torch.Tensor  # [R] fp32: the datum mask m
    lengths: list[int]  # tokens per datum slot

    @property
    def has_loss_terms(self) -> bool:
        return bool(self.mask.any())


def collate(
    datums: Sequence[Datum],
    indices: Sequence[int],
    input_names: Sequence[str],
    pad_token_id: int = 0,
    device: torch.device | str = "cpu",
) -> Microbatch:
    """Right-pad ``datums`` into one microbatch. ``indices[j] == PADDING`` marks a padding datum."""
    lengths = [len(d) for d in datums]
    width = max(lengths)
    ids = torch.full((len(datums), width), pad_token_id, dtype=torch.int64)
    attn = torch.zeros((len(datums), width), dtype=torch.int64)
    rows, segment, mask = [], [], []
    for j, (d, n) in enumerate(zip(datums, lengths, strict=True)):
        ids[j, :n] = d.model_input
        attn[j, :n] = 1
        rows.append(torch.arange(n) + j * width)
        segment.append(torch.full((n,), j, dtype=torch.int64))
        mask.append(torch.full((n,), 0.0 if indices[j] == PADDING else 1.0))
    targets = torch.cat([d.loss_fn_inputs["target_tokens"] for d in datums])
    inputs = {k: torch.cat([d.loss_fn_inputs[k] for d in datums]) for k in input_names}
    return Microbatch(
        indices=list(indices),
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        rows=torch.cat(rows).to(device),
        segment=torch.cat(segment).to(device),
        targets=targets.to(device),
        inputs={k: v.to(device) for k, v in inputs.items()},
        mask=torch.cat(mask).to(device),
        lengths=lengths,
    )
