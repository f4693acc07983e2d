"""The trainer interface everything drives: one engine (``TrainingEngine``, and its FSDP2 rank
``DistributedEngine``), a group of those ranks driven from one controller (``TrainerGroup``) or
the same ranks as Ray actors (``RayTrainerGroup``). Semantics are the TrainingEngine's (raw
sums, gradients accumulate until ``optim_step``).

A loss pass is one :class:`LossCall`: ``forward``/``forward_backward`` (the public signature,
declared here once) build it, and each trainer runs it in ``run_loss``; a rank group ships it
to its ranks whole.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, Unpack

from furlong.types import AdamParams, Datum, ForwardResult

StrPath = str | os.PathLike
Info = Mapping[str, Any] | None  # JSON values stored with a checkpoint and checked on load


class PassOptions(TypedDict, total=False):
    """``forward``/``forward_backward``'s keyword options (the same :class:`LossCall` fields)."""

    temperature: float
    sampling_masks: Sequence[Any] | None
    routed_experts: Sequence[Any] | None


@dataclass(frozen=True)
class LossCall:
    """One loss pass, as data (picklable: a rank group sends it to every rank).

    ``sampling_masks`` (one per datum, or None) replays the rollout's kept sets: a mask of
    ``n`` positions covers the datum's last ``n`` targets (the response), which are then
    scored over their kept set instead of the whole vocabulary. ``routed_experts`` (one
    ``[len(datum), layers, top_k]`` tensor per datum, or None) replays an MoE rollout's expert
    choices (see ``furlong.train.routing_replay``)."""

    datums: Sequence[Datum]
    loss_fn: str
    loss_fn_config: Mapping[str, object] | None = None
    backward: bool = False  # False: forward only (real losses, gradients untouched)
    temperature: float = 1.0
    sampling_masks: Sequence[Any] | None = None
    routed_experts: Sequence[Any] | None = None


class Trainer(ABC):
    """What the RL loop and the Tinker service need from a trainer."""

    def forward(
        self,
        datums: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, object] | None = None,
        **options: Unpack[PassOptions],
    ) -> ForwardResult:
        """The loss pass without backward: real losses and log-probs, gradients untouched."""
        return self.run_loss(LossCall(datums, loss_fn, loss_fn_config, False, **options))

    def forward_backward(
        self,
        datums: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, object] | None = None,
        **options: Unpack[PassOptions],
    ) -> ForwardResult:
        """The loss pass; gradients of the raw sum accumulate until ``optim_step``. Options:
        ``temperature``, ``sampling_masks``, ``routed_experts`` (see :class:`LossCall`)."""
        return self.run_loss(LossCall(datums, loss_fn, loss_fn_config, True, **options))

    @abstractmethod
    def run_loss(self, call: LossCall) -> ForwardResult:
        """Validate the whole call, then run it (nothing changes when it is refused)."""

    @abstractmethod
    def optim_step(self, adam_params: AdamParams | None = None) -> dict[str, float]: ...

    @abstractmethod
    def zero_grad(self) -> None: ...

    @abstractmethod
    def save_state(self, path: StrPath, info: Info = None) -> Path: ...

    @abstractmethod
    def load_state(self, path: StrPath, optimizer: bool = True, expect_info: Info = None) -> None:
        """Restore ``save_state``'s weights (and optimizer state); checked before any change."""

    @abstractmethod
    def export_hf(self, path: StrPath) -> Path: ...

    @abstractmethod
    def weights(self) -> Any:
        """What this trainer's rollout side takes in ``update_weights`` to sample like it."""

    def close(self) -> None:  # noqa: B027 - a trainer in this process holds nothing to stop
        """Release what the trainer holds beyond this process (rank processes, Ray actors)."""
