"""How one loss pass is spread over processes.

The TrainingEngine validates a call, then runs it through a ``Parallel``: which microbatches
this process runs, what happens around each of them, and how every process's results come
together. :class:`OneProcess` runs them all here; FSDP2 ranks are the other strategy
(:class:`furlong.train.distributed.FSDPRanks`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from furlong.train.batching import plan_microbatches

Results = list[tuple[int, dict[str, torch.Tensor]]]  # (request index, per-datum outputs)


class Parallel(Protocol):
    def microbatches(self, lengths: Sequence[int], token_budget: int) -> list[list[int]]:
        """This process's microbatches of one call, as request indices (``PADDING`` slots,
        whose datum has mask 0, keep ranks in step)."""
        ...

    def around_microbatch(self) -> AbstractContextManager[None]: ...

    def gather(
        self, loss_sum: float, results: Results, n: int
    ) -> tuple[list[dict[str, torch.Tensor]], float]:
        """The whole call's per-datum outputs in request order, and its loss sum."""
        ...


class OneProcess:
    """Every microbatch in this process."""

    def microbatches(self, lengths: Sequence[int], token_budget: int) -> list[list[int]]:
        return plan_microbatches(list(lengths), token_budget)

    def around_microbatch(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def gather(
        self, loss_sum: float, results: Results, n: int
    ) -> tuple[list[dict[str, torch.Tensor]], float]:
        return collect_outputs(results, n), loss_sum


def collect_outputs(
    results: Iterable[tuple[int, dict[str, torch.Tensor]]], n: int
) -> list[dict[str, torch.Tensor]]:
    """Per-datum outputs in request order, each datum exactly once."""
    outputs: list[dict[str, torch.Tensor] | None] = [None] * n
    for index, out in results:
        if outputs[index] is not None:
            raise RuntimeError(f"datum {index} produced two outputs in one call")
        outputs[index] = out
    done = [o for o in outputs if o is not None]
    if len(done) != n:
        raise RuntimeError("a datum produced no output")
    return done
