"""The one seam between a trainer's weights and the rollout side."""

from __future__ import annotations

from furlong.rollout.base import RolloutEngine
from furlong.train.api import Trainer


def publish_weights(trainer: Trainer, rollout: RolloutEngine, version: int) -> int:
    """The trainer's current weights to the rollout engine(s), as weight ``version``: whatever
    the trainer is (one engine, awake or asleep under colocation; a rank group; a Ray group,
    whose weights stay in Ray's object store) its ``weights()`` is what its rollout side's
    ``update_weights`` takes."""
    return rollout.update_weights(trainer.weights(), version)
