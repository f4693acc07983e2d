"""Typed RL configuration, grouped by part; loaded from TOML and overridden on the CLI.

    furlong train run.toml rollout.group_size=4 algo.advantage=gae critic.warmup_steps=5

Each ``[table]`` of the TOML file fills one group; ``group.field=value`` overrides parse the
value as a TOML literal (so ``4``, ``1e-3``, ``true`` and ``["kv_cache"]`` all work; bare words
are strings), and ``group.table.key=value`` sets one key of a table field
(``algo.objective_config.beta=0.1``). :meth:`RLConfig.validate` rejects incompatible
combinations and says what to change.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from furlong.errors import InputError, did_you_mean
from furlong.precision import DTYPES
from furlong.rl.config_source import check_model_name, raw_config
from furlong.rl.rollout_choice import check_choice
from furlong.rl.scale import ScaleOut
from furlong.rl.task_sources import check_task_config
from furlong.train.objectives import OBJECTIVES
from furlong.train.optim import OptimizerConfig

if TYPE_CHECKING:
    from furlong.rl.handoff import HandoffConfig


# the actor's objectives: the registry's that learn from advantages
ACTOR_OBJECTIVES = tuple(n for n, o in OBJECTIVES.items() if "advantages" in o.inputs)
# [algo] fields older than algo.objective_config, each one loss_fn_config key by a short name
KNOBS = {"clip_low": "clip_low_threshold", "clip_high": "clip_high_threshold", "dro_beta": "beta"}


def objectives_taking(key: str) -> tuple[str, ...]:
    """The actor objectives whose loss_fn_config has ``key``."""
    return tuple(n for n in ACTOR_OBJECTIVES if key in OBJECTIVES[n].defaults)


@dataclass(frozen=True)
class ModelConfig:
    """The policy to train (the critic, when used, starts from the same weights)."""

    # a preset (tiny-qwen3, small-qwen3, tiny-qwen3-moe, ...) or a local HF directory
    name: str = "small-qwen3"
    seed: int = 0  # seed of a preset's random weights
    device: str = "cpu"  # cpu | cuda | cuda:N: trainer, critic and rollout engine share it
    # float32 | bfloat16 | auto (bf16 where the device has native bf16 matmuls: furlong.precision);
    # bf16 trains fp32 master weights and computes log-probs in fp32
    dtype: str = "float32"
    lora_rank: int = 0  # > 0: train a LoRA adapter of this rank (peft) instead of every weight
    lora_attn: bool = True  # the adapter covers the attention projections
    lora_mlp: bool = True  # ... the MLP projections (MoE experts included)
    lora_unembed: bool = False  # ... the LM head


@dataclass(frozen=True)
class TaskConfig:
    """Problems and the verifier that rewards a response (docs/tasks.md). A name or reward of
    the form ``"module:function"`` is your own (docs/rl.md, "Your own task and reward")."""

    # addition | largest | reverse | jsonl | reasoning_gym:<dataset> | datasets:<file, directory
    # or cached name> | "module:function"
    name: str = "addition"
    path: str = ""  # the JSONL file for name = "jsonl" (a plug-in task receives it too)
    # auto (the source's own: reasoning-gym's score_answer, else exact_number) | exact_number |
    # exact_match | contains | numeric | math_verify | "module:function"
    reward: str = "auto"
    max_a: int = 99  # addition: a in [0, max_a]; largest / reverse: digits per string
    max_b: int = 9  # addition: b in [0, max_b]
    config: dict[str, Any] = field(default_factory=dict)  # reasoning_gym: the generator's
    args: dict[str, Any] = field(default_factory=dict)  # a plug-in task function's arguments
    # the user's message; {question} (reasoning_gym) or a row's fields (datasets); "": as given
    template: str = ""
    system: str = ""  # a system message before it ("": the chat template's default)
    prompt_field: str = "prompt"  # datasets: the column holding the question
    answer_field: str = "answer"  # datasets: the column holding the reference answer
    # how the reply's answer is found before the verifier sees it: whole | first_number |
    # last_number | answer_tag (<answer>...</answer>) | boxed (\boxed{...}) | auto (answer_tag
    # for reasoning_gym, else whole)
    extract: str = "auto"
    # added to the reward when a reply ends with its end token and has an answer to extract
    format_reward: float = 0.0
    # before training: constant and empty replies are scored on the train split, and one that
    # earns > 10% is refused (refuse), reported (warn) or not checked (off); auto: refuse for
    # reasoning_gym and datasets, off for the rest
    constant_check: str = "auto"
    eval_size: int = 0  # held-out problems to evaluate; 0: all of them (reasoning_gym: 200)
    eval_samples: int = 4  # sampled pass@1 draws per held-out problem (0: greedy only)
    eval_pass_k: int = 0  # > 1: also pass@k from the eval_samples draws (unbiased estimator)


@dataclass(frozen=True)
class WarmupConfig:
    """Supervised warm-up on the task's train split before RL (0 steps: none)."""

    steps: int = 0  # cross-entropy steps on the train split (0: no warm-up)
    batch_size: int = 32  # problems per step
    learning_rate: float = 3e-3  # AdamW
    # a noisy teacher: this share of demonstrations shows the problem's decoy (a plausible
    # wrong answer) instead of its answer; the warm-up then imitates a mix RL can sharpen
    decoy_share: float = 0.0


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling: one RL step draws ``prompts_per_step * group_size`` responses."""

    prompts_per_step: int = 16  # problems drawn per RL step
    group_size: int = 8  # samples per prompt
    max_tokens: int = 8  # new tokens per sample at most
    temperature: float = 1.0  # the trainer scores at the same temperature
    top_p: float = 1.0  # nucleus sampling; < 1 turns sampling-mask replay on
    top_k: int = 0  # 0: off; top_p < 1 or top_k > 0 turns sampling-mask replay on
    # embedded (in process) | sglang (rollout.urls) | vllm (urls or vllm_python) | ray ([scale])
    engine: str = "embedded"
    urls: list[str] = field(default_factory=list)  # sglang, vllm: the servers' base URLs
    staging_dir: str = ""  # sglang, vllm: a directory the servers read published weights from
    vllm_python: str = ""  # vllm: start a server with this Python ("auto": make vllm-venv's)
    vllm_transport: str = "disk"  # vllm: disk (reload from staging_dir) | nccl (GPU, vLLM's)
    vllm_threads: int = 0  # vllm, started here: its OpenMP threads (0: vLLM's choice)


@dataclass(frozen=True)
class AlgoConfig:
    """Advantages, the actor objective and its optimizer."""

    advantage: str = "grpo"  # grpo | gae (PPO with the critic) | reinforce_pp
    # a furlong.train.objectives loss that takes advantages: importance_sampling, ppo, ...
    objective: str = "importance_sampling"
    # the objective's loss_fn_config, e.g. {beta = 0.1}; keys and defaults: train/objectives.py
    objective_config: dict[str, float] = field(default_factory=dict)
    clip_low: float | None = None  # short for objective_config's clip_low_threshold
    clip_high: float | None = None  # short for objective_config's clip_high_threshold
    dro_beta: float | None = None  # short for objective_config's beta (dro's penalty)
    normalize: str = "token"  # token: / response tokens in the batch; sequence: / (len * seqs)
    scale_by_std: bool = True  # GRPO: divide by the group's std
    gamma: float = 1.0  # discount (gae, reinforce_pp)
    lam: float = 0.95  # GAE lambda
    kl_coef: float = 0.0  # KL-in-reward to a frozen copy of the starting policy
    learning_rate: float = 1e-3  # the actor's AdamW learning rate
    grad_clip_norm: float = 1.0  # global-norm clip (0: off)
    minibatches: int = 1  # optimizer steps per rollout batch
    share_prefixes: bool = True  # a group's prompt runs through the trunk once (same math)
    # rollout correction (rl/rollout_correction.py): weight each token by min(p_train / q_rollout,
    # tis_cap), the ratio taken against the trainer's log-probs; 0: off (for another engine)
    tis_cap: float = 0.0


@dataclass(frozen=True)
class CriticConfig:
    """Used by ``algo.advantage = "gae"`` only."""

    learning_rate: float = 3e-3  # the critic's own AdamW learning rate
    warmup_steps: int = 0  # critic-only steps before the actor trains
    value_clip: float | None = 0.2  # clip new values to old +- this (None: unclipped loss)


@dataclass(frozen=True)
class ColocateConfig:
    """Trainer and rollout engine share the device; see ``furlong.rl.handoff``."""

    enabled: bool = False  # run the hand-off events around every generate and publish
    # what the rollout releases while the trainer runs: kv_cache and / or weight
    offload_rollout_level: list[str] = field(default_factory=lambda: ["kv_cache", "weight"])
    memory_peak_device: str = "cpu"  # cpu: host holds mirror + backup; gpu: one at a time


@dataclass(frozen=True)
class RunConfig:
    """Length, evaluation and outputs of the run."""

    steps: int = 60  # RL steps
    eval_every: int = 10  # held-out evaluation every this many steps (and at the end)
    # samples.jsonl gets every evaluation's replies, and every this many steps the replies
    # the step trained on (0: evaluations only)
    samples_every: int = 0
    out_dir: str = "runs/rl"  # metrics.jsonl, warmup.jsonl, curves.png, policy/
    seed: int = 0  # problems, sampling and the critic's head
    export_hf: bool = True  # write the final policy as an HF directory (LoRA: merged)
    # LoRA: also write the adapter alone (peft) in policy_adapter/, and after a warm-up the
    # warmed-up base it adapts in policy_base/ (which the adapter names)
    export_adapter: bool = False
    tensorboard: bool = True  # mirror metrics to TensorBoard under out_dir/tensorboard/
    wandb: bool = False  # mirror metrics to wandb (pip install wandb; WANDB_MODE=offline works)
    wandb_project: str = "furlong"  # the wandb project the run logs to
    # a checkpoint every this many steps and at the end, under out_dir/checkpoints/, to
    # continue bit-identically with `furlong train --resume` (0: none)
    save_every: int = 0
    log_kl: bool = True  # report KL to the starting policy without a penalty (one more forward)
    progress: bool = True  # progress bars


@dataclass(frozen=True)
class RLConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    colocate: ColocateConfig = field(default_factory=ColocateConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scale: ScaleOut = field(default_factory=ScaleOut)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def uses_critic(self) -> bool:
        return self.algo.advantage == "gae"

    @property
    def loss_fn_config(self) -> dict[str, float]:
        """What the actor step sends: ``algo.objective_config`` and the short-named knobs set
        (the objective's defaults fill the rest)."""
        knobs = {key: getattr(self.algo, knob) for knob, key in KNOBS.items()}
        return dict(self.algo.objective_config) | {k: v for k, v in knobs.items() if v is not None}

    def validate(self) -> RLConfig:
        """Reject incompatible settings with a message that says what to change."""
        a, r = self.algo, self.rollout
        _one_of("algo.advantage", a.advantage, ("grpo", "gae", "reinforce_pp"))
        _one_of("algo.objective", a.objective, ACTOR_OBJECTIVES)
        _one_of("algo.normalize", a.normalize, ("token", "sequence"))
        check_task_config(self.task)  # imports plug-ins; a source's extra is installed
        # fast and offline-safe: an unknown name fails here, not in hub retries at the load
        check_model_name(self.model.name)
        _one_of("model.dtype", self.model.dtype, DTYPES)
        device = self.model.device
        if device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", device):
            raise InputError(f"model.device: {device!r}; expected cpu, cuda or cuda:N")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise InputError(f"model.device: {device!r}, but torch sees no CUDA device")
        for name, value in [
            ("rollout.prompts_per_step", r.prompts_per_step),
            ("rollout.group_size", r.group_size),
            ("rollout.max_tokens", r.max_tokens),
            ("algo.minibatches", a.minibatches),
            ("run.eval_every", self.run.eval_every),
        ]:
            if value < 1:
                raise InputError(f"{name}: must be >= 1, got {value}")
        share = self.warmup.decoy_share
        if not 0.0 <= share < 1.0:
            raise InputError(f"warmup.decoy_share: must be in [0, 1), got {share}")
        self._check_lora()
        check_choice(r.engine, r.urls, self.scale.ray, r.vllm_python, r.vllm_transport)
        if r.engine == "vllm":
            self._check_vllm()
        if self.rollout.engine in ("sglang", "vllm") and self.scale.enabled:
            raise InputError(
                f"rollout.engine: {self.rollout.engine!r} with [scale]: the scale-out places "
                "its own engines (use rollout.engine = 'embedded' there)"
            )
        if self.run.samples_every < 0:
            raise InputError(f"run.samples_every: must be >= 0, got {self.run.samples_every}")
        if self.run.save_every < 0:
            raise InputError(f"run.save_every: must be >= 0 (0: none), got {self.run.save_every}")
        if a.advantage == "grpo" and r.group_size < 2:
            raise InputError(
                "rollout.group_size: GRPO compares samples of one prompt, so it needs >= 2 "
                f"(got {r.group_size}); or set algo.advantage = 'gae' or 'reinforce_pp'"
            )
        batch = r.prompts_per_step * r.group_size
        if batch % a.minibatches:
            raise InputError(
                f"algo.minibatches: {a.minibatches} does not divide the batch of {batch} "
                "samples (rollout.prompts_per_step * rollout.group_size)"
            )
        self._check_objective_config()
        if not 0 <= a.gamma <= 1 or not 0 <= a.lam <= 1:
            raise InputError("algo.gamma and algo.lam: must be in [0, 1]")
        if a.tis_cap < 0 or not math.isfinite(a.tis_cap):
            raise InputError(f"algo.tis_cap: must be finite and >= 0 (0: off), got {a.tis_cap}")
        if a.kl_coef < 0:
            raise InputError(f"algo.kl_coef: must be >= 0, got {a.kl_coef}")
        if self.critic.warmup_steps and not self.uses_critic:
            raise InputError("critic.warmup_steps: needs the critic (algo.advantage = 'gae')")
        clip = self.critic.value_clip
        if clip is not None and not (math.isfinite(clip) and clip > 0):
            raise InputError(f"critic.value_clip: must be finite and > 0 (or None), got {clip}")
        try:  # checked even while off: a typo must not wait for the day it is switched on
            self.handoff().validate(has_critic=self.colocate.enabled and self.uses_critic)
        except InputError as exc:
            raise InputError(f"colocate.{exc}") from None
        self.scale.check(self.colocate.enabled)
        return self

    def _check_objective_config(self) -> None:
        a = self.algo
        takes = OBJECTIVES[a.objective].defaults
        for knob, key in KNOBS.items():
            if getattr(a, knob) is None:
                continue
            if key in a.objective_config:
                raise InputError(f"algo.{knob}: also set as algo.objective_config.{key}")
            if key in takes:
                continue
            if key.startswith("clip_"):  # the pair's message, as before objective_config
                raise InputError(
                    f"algo.clip_low/clip_high: only {', '.join(objectives_taking(key))} clip; "
                    f"algo.objective is {a.objective!r}"
                )
            alternatives = " or ".join(repr(n) for n in objectives_taking(key))
            raise InputError(f"algo.{knob}: only for algo.objective = {alternatives}")
        OBJECTIVES[a.objective].resolve_config(self.loss_fn_config, "algo.objective_config")

    def _check_vllm(self) -> None:
        """What vLLM's kind cannot do, said at config time (one line each)."""
        r = self.rollout
        if r.top_p < 1.0 or r.top_k > 0:
            raise InputError(
                "rollout.top_p / rollout.top_k: truncated sampling needs its kept sets for "
                "sampling-mask replay, which vLLM's CPU build does not return; use rollout.engine "
                '= "embedded", or top_p = 1 and top_k = 0'
            )
        if self.colocate.enabled:
            raise InputError(
                "colocate.enabled: vLLM's CPU worker ignores sleep/wake_up, so rollout.engine = "
                '"vllm" cannot hand its memory to the trainer; use the embedded engine'
            )
        if r.vllm_threads < 0:
            raise InputError(
                f"rollout.vllm_threads: must be >= 0 (0: vLLM's), got {r.vllm_threads}"
            )

    def _check_lora(self) -> None:
        m = self.model
        if m.lora_rank < 0:
            raise InputError(f"model.lora_rank: must be >= 0 (0: full), got {m.lora_rank}")
        if not m.lora_rank:
            if self.run.export_adapter:
                raise InputError("run.export_adapter: needs model.lora_rank > 0")
            return
        # not yet: the adapter's sleep/merge choreography and rank groups
        for name, on in (
            ("colocate.enabled", self.colocate.enabled),
            ("scale (trainer ranks / Ray)", self.scale.enabled),
        ):
            if on:
                raise InputError(f"model.lora_rank: LoRA is not supported with {name} yet")

    def handoff(self) -> HandoffConfig:
        from furlong.rl.handoff import HandoffConfig

        c = self.colocate
        return HandoffConfig(
            offload_rollout_level=frozenset(c.offload_rollout_level),
            memory_peak_device=c.memory_peak_device,
        )


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InputError(
            f"{name}: unknown {value!r}; expected one of {list(allowed)}"
            + did_you_mean(value, allowed)
        )


# ------------------------------------------------------------------ loading


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RLConfig:
    """Defaults ← TOML file ← ``group.field=value`` overrides, then validated."""
    return from_dict(raw_config(path, overrides)).validate()


def to_toml(config: RLConfig) -> str:
    """The whole config as TOML that :func:`load_config` reads back to an equal config (every
    value is a str, number, bool or list of str, whose JSON spelling is valid TOML, or a table
    of numbers; None fields are left out, None being their default)."""
    lines: list[str] = []
    for group in dataclasses.fields(config):
        lines.append(f"[{group.name}]")
        values = dataclasses.asdict(getattr(config, group.name))
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):  # an inline table: {"key" = value, ...}
        return "{" + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def from_dict(raw: dict[str, Any]) -> RLConfig:
    groups = {f.name: f for f in dataclasses.fields(RLConfig)}
    built = {}
    for group, values in raw.items():
        if group not in groups:
            raise InputError(
                f"config: unknown group [{group}]; expected one of {list(groups)}"
                + did_you_mean(group, groups)
            )
        if not isinstance(values, dict):
            raise InputError(f"config: [{group}] must be a table")
        factory = groups[group].default_factory
        assert factory is not dataclasses.MISSING  # every group field has a default_factory
        built[group] = _build(type(factory()), values, group)
    return RLConfig(**built)


def _build(cls: type, values: dict[str, Any], group: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for name, value in values.items():
        if name not in fields:
            raise InputError(
                f"{group}.{name}: unknown field; expected one of {sorted(fields)}"
                + did_you_mean(name, sorted(fields))
            )
        out[name] = _coerce(value, hints[name], f"{group}.{name}")
    return cls(**out)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check ``value`` against a field's type (ints widen to floats; None only if optional)."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for option in options:
        if option is type(None) and value is None:
            return None
        if option is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option in (str, bool) and type(value) is option:
            return value
        if (
            typing.get_origin(option) is list
            and isinstance(value, list)
            and all(isinstance(v, str) for v in value)  # list[str]: the only list field
        ):
            return list(value)
        if typing.get_origin(option) is dict and isinstance(value, dict):
            item = typing.get_args(option)[1]  # float, or Any: a TOML table of scalars / lists
            if item is Any:
                return {k: _scalar(v, f"{where}.{k}") for k, v in value.items()}
            return {k: _coerce(v, item, f"{where}.{k}") for k, v in value.items()}
    raise InputError(f"{where}: expected {_describe(hint)}, got {value!r}")


def _scalar(value: Any, where: str) -> Any:
    """A value of a free-form table (``task.config``, ``task.args``): a str, number or bool,
    or a list of them; no nested tables (``to_toml`` writes each table on one line)."""
    plain = (str, int, float, bool)
    if isinstance(value, plain) or (
        isinstance(value, list) and all(isinstance(v, plain) for v in value)
    ):
        return value
    raise InputError(f"{where}: expected a string, number, bool or a list of them, got {value!r}")


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) in (list, dict):
        return str(hint)  # list[str], dict[str, float]
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
