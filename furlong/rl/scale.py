"""``[scale]``: how many trainer ranks and rollout engines, and where (the run's placement;
``furlong.rl.scale_out`` builds it)."""

from __future__ import annotations

from dataclasses import dataclass

from furlong.errors import InputError
from furlong.extras import require


@dataclass(frozen=True)
class ScaleOut:
    """How many trainer ranks and rollout engines, and where (see the module doc). On
    ``model.device = "cuda"`` every rank and engine gets a GPU of its own (nccl between ranks)."""

    trainer_ranks: int = 1  # data-parallel FSDP2 ranks of the actor
    ray: str | None = None  # None: no Ray; "local": start Ray on this host; else an address
    rollout_engines: int = 1  # with Ray: engine actors (the batch is split across them)
    colocate: bool = False  # with Ray: rank i and engine i share a placement-group bundle

    @property
    def enabled(self) -> bool:
        return self.trainer_ranks > 1 or self.ray is not None

    def check(self, colocation: bool) -> None:
        for name in ("trainer_ranks", "rollout_engines"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"scale.{name}: must be an integer >= 1, got {value!r}")
        if self.ray is None and (self.rollout_engines > 1 or self.colocate):
            raise InputError("scale.rollout_engines / scale.colocate: need Ray (scale.ray)")
        if self.ray is not None:
            require("ray", "scale.ray (--ray)")
        if self.enabled and colocation:
            raise InputError(
                "colocate.enabled: the in-process hand-off needs a single-process trainer; "
                "with trainer ranks or Ray, place them with scale.colocate instead"
            )
