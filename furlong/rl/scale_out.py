"""Where the RL loop's trainer and rollout engines run beyond one process.

- ``trainer_ranks > 1`` (no Ray): a :class:`~furlong.train.group.TrainerGroup` of rank
  processes on this host; the rollout engine stays in the loop's process.
- ``ray`` set (``"local"`` or a cluster address): trainer ranks and rollout engines are Ray
  actors on one placement group (``colocate``: rank *i* and engine *i* share a bundle); the
  weights go from trainer rank 0 through the object store to every engine, and a dead engine
  is restarted and given the last weights again.

The ranks and engines load the same weights as the loop's policy: the preset (same seed) or
HF directory, or, after a supervised warm-up, the warmed policy written to ``warmup_policy/``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from furlong.errors import InputError
from furlong.models.loading import save_hf_dir
from furlong.rollout.base import RolloutEngine
from furlong.rollout.engine import EmbeddedEngine
from furlong.train.api import Trainer
from furlong.train.engine import EngineConfig
from furlong.train.group import RankSpec, TrainerGroup

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from furlong.rl.config import RLConfig


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
        if self.enabled and colocation:
            raise InputError(
                "colocate.enabled: the in-process hand-off needs a single-process trainer; "
                "with trainer ranks or Ray, place them with scale.colocate instead"
            )


def build(
    scale: ScaleOut,
    config: RLConfig,
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    max_running: int,
    engine_config: EngineConfig,
) -> tuple[Trainer, RolloutEngine]:
    """``(actor, rollout)`` for the loop: a trainer group and its rollout engine(s); every rank
    builds its engine from ``engine_config``, on a GPU of its own under ``cuda``."""
    m = config.model
    model = _weights_source(config, policy, tokenizer)
    gpus = m.device.startswith("cuda")
    engine = dataclasses.replace(engine_config, device="cuda" if gpus else m.device)
    spec = RankSpec(model, seed=m.seed, dtype=m.dtype, config=engine)
    if scale.ray is None:
        rollout = EmbeddedEngine(copy.deepcopy(policy), tokenizer, max_running=max_running)
        return TrainerGroup.from_spec(spec, scale.trainer_ranks), rollout
    from furlong.rl import placement, ray_rollout, ray_trainer

    plan = placement.plan(scale.trainer_ranks, scale.rollout_engines, scale.colocate, gpus)
    ray_trainer.connect(scale.ray, num_cpus=max(os.cpu_count() or 1, len(plan.bundles)))
    group = ray_trainer.create_placement_group(plan)
    actor = ray_trainer.RayTrainerGroup(spec, plan, group)
    engines = ray_rollout.start_engines(
        ray_rollout.EngineSpec(model, m.seed, max_running, m.dtype, engine.device),
        [ray_trainer.on_bundle(group, b) for b in plan.engines],
        [plan.resources(b) for b in plan.engines],
    )
    return actor, ray_rollout.RayRollout(engines)


def _weights_source(
    config: RLConfig, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> str:
    if not config.warmup.steps:
        return config.model.name
    return str(save_hf_dir(policy, tokenizer, Path(config.run.out_dir) / "warmup_policy"))
