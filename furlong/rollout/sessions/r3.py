"""Routing replay (R3) for sessions: which routed-expert rows each turn asks the engine for,
and how the records' patches are assembled into one ``[len(tokens) - 1, layers, top_k]`` block.

Row ``i`` is the routing of position ``i`` as fed forward; the trajectory's last token has none.
Under ``abort`` and ``in_place`` the rows of earlier turns never change, so a turn asks only
for rows from ``len(checkpoint) - 1`` on (incremental R3; the first row is the previous turn's
last token, which was sampled but never fed forward). Under ``retract`` every turn asks for
full rows instead, and assembly takes from each record only its own span: the rows a later
turn's prefill recomputed for earlier positions never replace the rows they were sampled with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from furlong.errors import InputError
from furlong.rollout.base import check_pause_mode
from furlong.rollout.sessions.records import TurnRecord


class AssemblyError(InputError):
    """The records do not assemble into rows for the trajectory (HTTP 422)."""


def use_addition_r3(pause_mode: str) -> bool:
    """Incremental R3 is safe unless in-flight turns may be recomputed (``retract``)."""
    return check_pause_mode(pause_mode) != "retract"


def request_offset(checkpoint_len: int, common_prefix: int) -> int:
    """``start_len`` for a turn extending a checkpoint of ``checkpoint_len`` tokens whose
    longest common prefix with the prompt is ``common_prefix``."""
    start = max(0, checkpoint_len - 1)
    if common_prefix < start:
        raise InputError(
            f"routed experts: the prompt shares {common_prefix} tokens with the checkpoint, "
            f"fewer than the offset {start}"
        )
    return start


def _name(i: int, record: TurnRecord) -> str:
    return f"records[{i}] (request {record.request_id})"


def assemble_incremental(records: Sequence[TurnRecord], n_tokens: int) -> torch.Tensor:
    """Concatenate the records' patches in order and cut them to ``n_tokens - 1`` rows.

    Each record must start exactly where the coverage stands, carry a payload iff its span is
    non-empty (an empty span is legal), with exactly that many rows. Coverage short of
    ``n_tokens - 1`` is an error; extra rows (a trimmed tail) are cut, never padded."""
    required, covered = max(0, n_tokens - 1), 0
    parts: list[torch.Tensor] = []
    for i, record in enumerate(records):
        start, end, rows = record.start_len, record.end, record.routed_experts
        if start is None:
            raise AssemblyError(f"{_name(i, record)}: no start_len (missing offset)")
        if start != covered:
            raise AssemblyError(
                f"{_name(i, record)}: start_len {start} != {covered} rows covered so far"
            )
        if end < start:
            raise AssemblyError(f"{_name(i, record)}: end {end} < start_len {start}")
        span = end - start
        if (rows is not None) != (span > 0):
            has = "a payload" if rows is not None else "no payload"
            raise AssemblyError(f"{_name(i, record)}: {has} for a span of {span} rows")
        if rows is not None:
            if rows.dim() != 3 or rows.shape[0] != span:
                raise AssemblyError(
                    f"{_name(i, record)}: payload shape {tuple(rows.shape)}, expected "
                    f"{span} rows [start_len {start}, end {end})"
                )
            parts.append(rows)
        covered = end
        if covered >= required:
            break
    if covered < required:
        raise AssemblyError(
            f"records: rows cover {covered} positions, the trajectory needs {required} "
            f"({len(records)} records)"
        )
    return _cut(parts, required)


def assemble_full(records: Sequence[TurnRecord], n_tokens: int) -> torch.Tensor:
    """Full R3 (``retract``): every turn returned rows from position 0, but only its own span,
    from where the previous record's rows end to its own end, is its to give. Its rows before
    that are its prefill's recomputation of earlier turns (under newer weights, perhaps), not
    the routes those turns sampled with, so a later turn never overwrites an earlier one."""
    spans: list[TurnRecord] = []
    covered = 0
    for i, record in enumerate(records):
        if record.start_len is not None:
            raise AssemblyError(
                f"{_name(i, record)}: start_len {record.start_len} under full R3 (expected none)"
            )
        rows = record.routed_experts
        have = 0 if rows is None else int(rows.shape[0])
        if rows is None or rows.dim() != 3 or have != record.end:
            shape = None if rows is None else tuple(rows.shape)
            raise AssemblyError(
                f"{_name(i, record)}: payload {shape}, expected {record.end} full rows"
            )
        own = rows[covered:] if record.end > covered else None
        spans.append(dataclasses.replace(record, start_len=covered, routed_experts=own))
        covered = max(covered, record.end)
    return assemble_incremental(spans, n_tokens)


def assemble_routed_experts(
    records: Sequence[TurnRecord], n_tokens: int, incremental: bool
) -> torch.Tensor:
    if incremental:
        return assemble_incremental(records, n_tokens)
    return assemble_full(records, n_tokens)


def _cut(parts: list[torch.Tensor], required: int) -> torch.Tensor:
    if not parts:
        raise AssemblyError("records: no routed-expert rows at all")
    return torch.cat(parts)[:required].to(torch.int32).clone()
