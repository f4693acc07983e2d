"""``SamplingMask``: the kept-token set of every sampled position, in CSR form.

With top-k / top-p, token ``a_t`` is drawn from the distribution renormalised over a kept set
``S_t``. A trainer that normalises over the whole vocabulary scores a different policy, so
the rollout records ``S_t`` and the trainer replays it. Position ``t``'s support is
``ids[offsets[t]:offsets[t + 1]]``; every support is non-empty (tokens the environment forced
get singleton supports), so an empty row never means "the whole vocabulary".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from furlong.csr import row_contains
from furlong.errors import InputError


def _integer_1d(value: object, name: str) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if t.dim() != 1:
        raise InputError(f"SamplingMask.{name}: expected a 1-D tensor, got {t.dim()}-D")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise InputError(f"SamplingMask.{name}: expected integers, got dtype {t.dtype}")
    return t


class SamplingMask:
    """Immutable CSR kept-token sets: int32 ``ids`` ``[total]``, int64 ``offsets`` ``[n + 1]``."""

    __slots__ = ("_ids", "_offsets")

    def __init__(self, ids: object, offsets: object):
        ids_t, offsets_t = _integer_1d(ids, "ids"), _integer_1d(offsets, "offsets")
        if offsets_t.numel() == 0 or int(offsets_t[0]) != 0:
            raise InputError("SamplingMask.offsets: must start with 0")
        if int(offsets_t[-1]) != ids_t.numel():
            raise InputError(
                f"SamplingMask.offsets: must end with len(ids) = {ids_t.numel()}, "
                f"got {int(offsets_t[-1])}"
            )
        steps = offsets_t[1:] - offsets_t[:-1]
        if bool((steps <= 0).any()):
            row = int((steps <= 0).nonzero()[0])
            raise InputError(f"SamplingMask: position {row} has an empty support")
        if ids_t.numel() and int(ids_t.min()) < 0:
            raise InputError("SamplingMask.ids: token ids must be >= 0")
        if ids_t.numel() and int(ids_t.max()) > torch.iinfo(torch.int32).max:
            raise InputError("SamplingMask.ids: token ids must fit in int32")
        # Owned CPU copies: a caller mutating its tensors later cannot change the mask.
        self._ids = ids_t.detach().to("cpu", torch.int32, copy=True)
        self._offsets = offsets_t.detach().to("cpu", torch.int64, copy=True)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_lists(cls, rows: Iterable[Sequence[int]]) -> SamplingMask:
        rows = [list(r) for r in rows]
        lengths = torch.tensor([0] + [len(r) for r in rows], dtype=torch.int64)
        ids = [i for r in rows for i in r]
        return cls(torch.tensor(ids, dtype=torch.int64), lengths.cumsum(0))

    @classmethod
    def singletons(cls, tokens: Sequence[int] | torch.Tensor) -> SamplingMask:
        """Supports ``{tok}`` for tokens the environment inserted (never sampled)."""
        ids = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        return cls(ids, torch.arange(ids.numel() + 1, dtype=torch.int64))

    @classmethod
    def concatenate(cls, masks: Sequence[SamplingMask]) -> SamplingMask:
        """Positions of ``masks`` in order; offsets rebased."""
        if not masks:
            return cls(torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))
        ids = torch.cat([m._ids for m in masks])
        parts, base = [torch.zeros(1, dtype=torch.int64)], 0
        for m in masks:
            parts.append(m._offsets[1:] + base)
            base += m._ids.numel()
        return cls(ids, torch.cat(parts))

    # ------------------------------------------------------------------ access

    def __len__(self) -> int:
        return self._offsets.numel() - 1

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Borrow ``(ids, offsets)`` without copying; callers must not mutate them."""
        return self._ids, self._offsets

    def row(self, t: int) -> list[int]:
        if not -len(self) <= t < len(self):
            raise IndexError(f"position {t} out of range for {len(self)} positions")
        t %= len(self)
        return self._ids[self._offsets[t] : self._offsets[t + 1]].tolist()

    def to_lists(self) -> list[list[int]]:
        return [self.row(t) for t in range(len(self))]

    def prefix(self, n: int) -> SamplingMask:
        """The first ``n`` positions (prefix truncation of a response)."""
        if not 0 <= n <= len(self):
            raise InputError(f"SamplingMask.prefix: n must be in [0, {len(self)}], got {n}")
        end = int(self._offsets[n])
        return SamplingMask(self._ids[:end], self._offsets[: n + 1])

    def select(self, rows: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat ids of arbitrary ``rows`` (in the given order) and each row's length.

        Contiguous runs of rows are sliced in one piece."""
        rows_t = torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
        if rows_t.numel() and (int(rows_t.min()) < 0 or int(rows_t.max()) >= len(self)):
            raise IndexError(f"SamplingMask.select: rows outside [0, {len(self)})")
        starts, ends = self._offsets[rows_t], self._offsets[rows_t + 1]
        pieces, i, n = [], 0, rows_t.numel()
        while i < n:
            j = i + 1
            while j < n and int(rows_t[j]) == int(rows_t[j - 1]) + 1:
                j += 1
            pieces.append(self._ids[int(starts[i]) : int(ends[j - 1])])
            i = j
        flat = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32)
        return flat, ends - starts

    def contains(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Bool ``[n]``: is ``tokens[t]`` in the support of position ``t``?"""
        tok = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        if tok.numel() != len(self):
            raise InputError(f"SamplingMask.contains: need {len(self)} tokens, got {tok.numel()}")
        return row_contains(self._ids, self._offsets, tok)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SamplingMask):
            return NotImplemented
        return torch.equal(self._ids, other._ids) and torch.equal(self._offsets, other._offsets)

    # unhashable, as it defines __eq__ (typeshed types object.__hash__ as a method, never None)
    __hash__ = None  # type: ignore[assignment]

    def __setattr__(self, name: str, value: object) -> None:
        if hasattr(self, "_offsets"):
            raise AttributeError("SamplingMask is immutable")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"SamplingMask(positions={len(self)}, ids={self._ids.numel()})"
