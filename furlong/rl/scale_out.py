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

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from furlong.models.loading import save_hf_dir
from furlong.precision import resolve_dtype
from furlong.rl.scale import ScaleOut
from furlong.train.api import Trainer
from furlong.train.engine import EngineConfig
from furlong.train.group import RankSpec, TrainerGroup

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from furlong.rl.config import RLConfig


def build(
    scale: ScaleOut,
    config: RLConfig,
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    max_running: int,
    engine_config: EngineConfig,
) -> tuple[Trainer, dict[str, Any] | None]:
    """``(actor, ray)`` for the loop: a trainer group, every rank built from
    ``engine_config`` (on a GPU of its own under ``cuda``); and with Ray, the options that
    place the rollout engines beside the ranks (for the registry's ``ray`` kind), else None."""
    m = config.model
    model = _weights_source(config, policy, tokenizer)
    gpus = m.device.startswith("cuda")
    engine = dataclasses.replace(engine_config, device="cuda" if gpus else m.device)
    dtype = resolve_dtype(m.dtype, m.device)
    spec = RankSpec(model, seed=m.seed, dtype=dtype, config=engine)
    if scale.ray is None:
        return TrainerGroup.from_spec(spec, scale.trainer_ranks), None
    from furlong.rl import placement, ray_rollout, ray_trainer

    plan = placement.plan(scale.trainer_ranks, scale.rollout_engines, scale.colocate, gpus)
    ray_trainer.connect(scale.ray, num_cpus=max(os.cpu_count() or 1, len(plan.bundles)))
    group = ray_trainer.create_placement_group(plan)
    actor = ray_trainer.RayTrainerGroup(spec, plan, group)
    ray = {
        "engine": ray_rollout.EngineSpec(model, m.seed, max_running, dtype, engine.device),
        "strategies": [ray_trainer.on_bundle(group, b) for b in plan.engines],
        "resources": [plan.resources(b) for b in plan.engines],
    }
    return actor, ray


def _weights_source(
    config: RLConfig, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> str:
    if not config.warmup.steps:
        return config.model.name
    return str(save_hf_dir(policy, tokenizer, Path(config.run.out_dir) / "warmup_policy"))
