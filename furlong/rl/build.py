"""The parts of an RL run, built from its config before the first step.

:func:`build_parts` loads the policy, runs the supervised warm-up, and builds the actor (every
weight, or a LoRA adapter), the rollout engine (in process, an SGLang fleet, or with trainer
ranks and Ray, see ``furlong.rl.scale_out``), the frozen KL reference, the critic and the
colocated hand-off; on resume it puts the checkpoint's states into them. The loop
(``furlong.rl.loop.train``) only drives the :class:`Parts` it returns.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from furlong.models.loading import load_model
from furlong.models.moe import find_routers
from furlong.precision import resolve_dtype
from furlong.rl import resume as resume_mod
from furlong.rl import scale_out, warmup
from furlong.rl.config import ModelConfig, RLConfig, RolloutConfig
from furlong.rl.critic import build_critic
from furlong.rl.evaluation import Evaluation, evaluate
from furlong.rl.publish import publish_weights
from furlong.rl.rollout_choice import build_rollout, rollout_kind
from furlong.rl.scale import ScaleOut
from furlong.rl.task_sources import held_out, make_task
from furlong.rl.tasks import Problem, Task
from furlong.rollout.base import RolloutEngine
from furlong.rollout.sampling import SamplingParams
from furlong.train.api import Trainer
from furlong.train.engine import EngineConfig, TrainingEngine
from furlong.train.optim import OptimizerConfig

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from furlong.metrics import MetricsLog
    from furlong.rl.handoff import Colocation

ADAPTER = "actor"  # the peft adapter's name in a LoRA run


@dataclass
class Parts:
    """What the loop drives: the engines, the task and the sampling settings of one run."""

    actor: Trainer
    rollout: RolloutEngine
    reference: TrainingEngine | None  # the frozen KL reference (algo.kl_coef or run.log_kl)
    critic: TrainingEngine | None  # algo.advantage = "gae": a value head, the value loss
    colocation: Colocation | None  # colocate.enabled: trainer and rollout take turns
    task: Task
    held_out: Sequence[Problem]  # the evaluation's problems
    params: SamplingParams  # the rollout's settings (the loop sets each step's seed)
    tokenizer: PreTrainedTokenizerBase
    rng: random.Random  # the loop's: the warm-up and each step's problems draw from it
    warmup_losses: list[float] = field(default_factory=list)  # per warm-up step, if one ran
    # a LoRA run: its peft model (the adapter to export) and, after a warm-up, the base it
    # adapts (model, tokenizer), which every checkpoint holds
    adapter: PeftModel | None = None
    warmed_base: tuple[PreTrainedModel, PreTrainedTokenizerBase] | None = None

    def evaluate(self, samples: int, pass_k: int = 0) -> Evaluation:
        """Held-out accuracy: greedy, and pass@1 over ``samples`` draws per problem."""
        held_out, params = self.held_out, self.params
        return evaluate(self.rollout, self.tokenizer, self.task, held_out, params, samples, pass_k)


def build_parts(
    config: RLConfig,
    scale: ScaleOut,
    saved: resume_mod.Checkpoint | None,
    warmup_log: MetricsLog | None = None,
) -> Parts:
    """The run's parts, seeded by ``run.seed``; ``saved``: the checkpoint to resume from (its
    states restored, the generator states last), None for a fresh run. ``warmup_log`` gets each
    warm-up step's loss as it finishes."""
    m, t, ro = config.model, config.task, config.rollout
    rng = random.Random(config.run.seed)
    torch.manual_seed(config.run.seed)
    engine_config = EngineConfig(
        device=m.device, optimizer=config.optimizer, share_prefixes=config.algo.share_prefixes
    )
    source = resume_mod.model_source(saved, m.name)  # a LoRA run's warmed-up base on resume
    policy, tokenizer = load_policy(source, m)
    policy.to(m.device)  # type: ignore[arg-type]  # in place; see ray_rollout.RolloutActor
    if m.lora_rank and m.lora_unembed:
        from furlong.train.lora import untie_embeddings  # peft: only LoRA runs need it

        untie_embeddings(policy)  # the adapted head is no longer the embedding
    task = make_task(t)
    losses: list[float] = []
    if config.warmup.steps and saved is None:  # a resumed run has its warm-up in the checkpoint
        engine = TrainingEngine(policy, tokenizer, engine_config)
        progress = config.run.progress
        losses = warmup.supervised_warmup(engine, task, config.warmup, rng, progress, warmup_log)
    batch = ro.prompts_per_step * ro.group_size
    adapter, ray = None, None
    if scale.enabled:  # trainer ranks (with Ray, the engines' placement too) in other processes
        actor, ray = scale_out.build(scale, config, policy, tokenizer, batch, engine_config)
    else:
        actor = trainer_for(config, policy, tokenizer, engine_config)  # a fresh optimizer for RL
        adapter = cast("PeftModel", actor.model) if m.lora_rank else None  # see _actor
    kind, staging = rollout_kind(ro.engine, scale), ro.staging_dir or None
    vllm = _vllm_options(ro) if kind == "vllm" else None
    rollout = build_rollout(
        kind, ro.urls, policy, tokenizer, batch, staging_dir=staging, ray=ray, vllm=vllm
    )
    reference = _reference(config, policy, engine_config)
    critic = build_critic(config, policy, engine_config)
    if saved is not None:  # the copies above started from the model as loaded
        resume_mod.restore_reference(saved, reference)
        critic = resume_mod.restore_critic(  # the actor's weights only if the critic's are gone
            saved,
            critic,
            lambda: build_critic(config, resume_mod.actor_model(saved, policy), engine_config),
        )
    colocation = _colocation(config, actor, rollout, saved)  # a colocated actor loads in there
    if saved is not None and colocation is None:
        resume_mod.restore_actor(saved, actor)
        publish_weights(actor, rollout, saved.weight_version)
    if saved is not None:
        resume_mod.restore_rng(saved, rng)  # last: the set-up above draws from torch's
    return Parts(
        actor=actor,
        rollout=rollout,
        reference=reference,
        critic=critic,
        colocation=colocation,
        task=task,
        held_out=held_out(task, t),
        params=sampling_params(config, policy),
        tokenizer=tokenizer,
        rng=rng,
        warmup_losses=losses,
        adapter=adapter,
        warmed_base=(policy, tokenizer) if m.lora_rank and config.warmup.steps else None,
    )


def load_policy(source: str, m: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``source`` (a preset, an HF directory) in ``model.dtype``, a preset seeded by
    ``model.seed``; on the CPU (the caller moves it to ``model.device``)."""
    dtype = getattr(torch, resolve_dtype(m.dtype, m.device))
    return load_model(source, seed=m.seed, dtype=dtype)


def sampling_params(config: RLConfig, policy: PreTrainedModel) -> SamplingParams:
    ro = config.rollout
    return SamplingParams(
        max_tokens=ro.max_tokens,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=ro.top_k,
        return_sampling_mask=ro.top_p < 1.0 or ro.top_k > 0,  # replay the kept sets
        return_routed_experts=bool(find_routers(policy)),  # MoE: replay the routes (R3)
    )


def trainer_for(
    config: RLConfig,
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    engine_config: EngineConfig,
) -> TrainingEngine:
    """The trainer: every weight of the policy, or (``model.lora_rank``) a LoRA adapter on a
    weight-sharing view of it, built by the same code as the Tinker service's adapters."""
    m = config.model
    if not m.lora_rank:
        return TrainingEngine(policy, tokenizer, engine_config)
    from furlong.train import lora

    spec = lora.LoraSpec(
        rank=m.lora_rank, train_mlp=m.lora_mlp, train_attn=m.lora_attn, train_unembed=m.lora_unembed
    )
    peft = lora.add_adapter(None, policy, ADAPTER, lora.peft_config(policy, spec), config.run.seed)
    return TrainingEngine(
        peft,
        tokenizer,
        engine_config,
        trainable=lora.adapter_params(peft, ADAPTER),
        merged=functools.partial(lora.merged_model, peft),
    )


def _reference(
    config: RLConfig, policy: PreTrainedModel, engine_config: EngineConfig
) -> TrainingEngine | None:
    """A frozen copy of the policy as it is now, kept for the KL (or to log it)."""
    if not (config.algo.kl_coef > 0 or config.run.log_kl):
        return None
    frozen = dataclasses.replace(engine_config, optimizer=OptimizerConfig())  # never steps
    # no trainable parameters: no optimizer state, and no fp32 masters of a bf16 model
    return TrainingEngine(copy.deepcopy(policy).requires_grad_(False), None, frozen)


def _colocation(
    config: RLConfig,
    actor: Trainer,
    rollout: RolloutEngine,
    saved: resume_mod.Checkpoint | None,
) -> Colocation | None:
    """The hand-off's start-up: the trainer loads (on resume, the checkpoint's actor) and
    sleeps, and the rollout takes its weights."""
    if not config.colocate.enabled:
        return None
    assert isinstance(actor, TrainingEngine)  # colocation runs one trainer here (scale.check)
    from furlong.rl.handoff import Colocation

    colocation = Colocation(actor, rollout, config.handoff(), has_critic=config.uses_critic)
    if saved is None:
        load, version = (lambda: None), 0
    else:  # the contract's "trainer init + checkpoint load"
        load = functools.partial(resume_mod.restore_actor, saved, actor)
        version = saved.weight_version
    colocation.startup(load, functools.partial(publish_weights, actor, rollout, version))
    return colocation


def _vllm_options(ro: RolloutConfig) -> dict[str, Any]:
    """The vLLM kind's own ``rollout.*`` fields, as its options."""
    threads = ro.vllm_threads or None
    return {
        "vllm_python": ro.vllm_python,
        "vllm_transport": ro.vllm_transport,
        "vllm_threads": threads,
    }
