"""The trainer interface the RL loop drives: one engine (``TrainingEngine``), a group of FSDP2
ranks driven from one controller (``TrainerGroup``) or the same ranks as Ray actors
(``RayTrainerGroup``). Semantics are the TrainingEngine's (raw sums, gradients accumulate
until ``optim_step``)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from furlong.types import AdamParams, Datum, ForwardResult


class Trainer(Protocol):
    def forward(
        self,
        datums: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, object] | None = None,
        *,
        temperature: float = 1.0,
        sampling_masks: Sequence[Any] | None = None,
        routed_experts: Sequence[Any] | None = None,
    ) -> ForwardResult: ...

    def forward_backward(
        self,
        datums: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, object] | None = None,
        *,
        temperature: float = 1.0,
        sampling_masks: Sequence[Any] | None = None,
        routed_experts: Sequence[Any] | None = None,
    ) -> ForwardResult: ...

    def optim_step(self, adam_params: AdamParams | None = None) -> dict[str, float]: ...

    def save_state(
        self, path: str | os.PathLike, info: Mapping[str, Any] | None = None
    ) -> Path: ...

    def load_state(
        self,
        path: str | os.PathLike,
        optimizer: bool = True,
        expect_info: Mapping[str, Any] | None = None,
    ) -> None: ...

    def export_hf(self, path: str | os.PathLike) -> Path: ...

    def weights(self) -> Any:
        """What this trainer's rollout side takes in ``update_weights`` to sample like it."""
        ...
