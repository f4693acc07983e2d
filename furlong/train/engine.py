"""The TrainingEngine: the core every front door (Python API, RL loop, Tinker service) drives.

    forward · forward_backward · optim_step · save_state · load_state · export_hf

Semantics are Tinker's: raw sums over tokens and datums (the caller owns normalization),
gradients accumulate across calls until ``optim_step``, and ``forward`` is the same loss pass
with backward switched off.

An engine may train a named subset of the model's parameters (``trainable``, e.g. one LoRA
adapter of a model shared with other engines): its optimizer, clipping, ``zero_grad`` and
checkpoints then cover only that subset. Which adapter the shared model runs is the caller's
business: activate it before every call.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast

import torch
from peft import PeftModel
from torch.utils.checkpoint import checkpoint

from furlong.errors import InputError
from furlong.models.critic import ValueModel
from furlong.models.fast_forward import FastForward
from furlong.models.loading import load_model, save_hf_dir
from furlong.train import checkpoint as ckpt
from furlong.train.api import Info, LossCall, StrPath, Trainer
from furlong.train.batching import PADDING, Microbatch, collate
from furlong.train.filemap import is_file_backed
from furlong.train.logprobs import (
    RowSupports,
    auto_chunk_size,
    graph_connected_zero,
    head_logprobs,
)
from furlong.train.master_weights import MasterWeights
from furlong.train.objectives import OBJECTIVES, VALUE_OBJECTIVES, Objective, datum_losses
from furlong.train.optim import OptimizerConfig, build_optimizer, optimizer_step
from furlong.train.parallel import OneProcess, Parallel, Results
from furlong.train.prefix_sharing import Trunk, plan_prefixes, shared_prefix_hidden
from furlong.train.replay import concat_supports, row_supports
from furlong.train.routing_replay import check_routing, forced_rows, replay_routing
from furlong.train.turns import turn_point
from furlong.train.validation import check_losses, validate_batch
from furlong.types import AdamParams, Datum, ForwardResult

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

    # What a TrainingEngine trains: an HF causal LM, a peft model over one (LoRA adapters),
    # or a critic. What the engine reads of it, all three have.
    TrainedModel: TypeAlias = PreTrainedModel | PeftModel | ValueModel

T = TypeVar("T")


@dataclass(frozen=True)
class EngineConfig:
    max_tokens_per_microbatch: int = 8192  # padded tokens per forward pass; <= 0: one pass
    logprob_chunk_size: int | None = None  # rows per log-prob chunk; None: auto; <= 0: off
    recompute_loss: bool = False  # activation-checkpoint the loss (head + objective)
    gradient_checkpointing: bool = False  # HF activation checkpointing of the trunk
    # dense Qwen3/Qwen2/Llama trunks through FastForward (same ops, fused RMSNorm backward)
    fast_forward: bool = True
    device: str = "cpu"
    # run a prompt shared by several datums (a GRPO group) through the trunk once
    share_prefixes: bool = False
    optimizer: OptimizerConfig = OptimizerConfig()  # kind (adamw | muon) and state store


@dataclass(frozen=True)
class ValidCall:
    """A validated loss pass: what each of its microbatches needs besides the datum indices."""

    datums: Sequence[Datum]
    objective: Objective
    config: Mapping[str, float]
    temperature: float
    backward: bool
    supports: list[RowSupports] | None  # per datum: the rollout's kept sets
    routing: list[torch.Tensor | None] | None  # per datum: MoE routes to replay


def call_metrics(datums: Sequence[Datum], loss_sum: float) -> dict[str, float]:
    return {
        "loss:sum": loss_sum,
        "num_tokens:sum": float(sum(len(d) for d in datums)),
        "num_datums:sum": float(len(datums)),
    }


def padding_datum(like: Datum) -> Datum:
    """One token shaped like ``like`` (so top-K targets concatenate) whose mask is 0: what a
    ``PADDING`` slot of a microbatch runs."""
    return Datum(like.model_input[:1], {k: v[:1] for k, v in like.loss_fn_inputs.items()})


class TrainingEngine(Trainer):
    """Trains one causal LM. Every loss, log-prob and gradient of furlong goes through here."""

    def __init__(
        self,
        model: TrainedModel,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        trainable: Sequence[tuple[str, torch.nn.Parameter]] | None = None,
        merged: Callable[[], PreTrainedModel] | None = None,
        parallel: Parallel | None = None,
    ):
        """``trainable``: a subset of the model's parameters (e.g. a LoRA adapter's) by name;
        ``merged``: for an adapter, a plain model with it merged (what rollout engines and HF
        exports get instead of the adapter); ``parallel``: how a pass spreads over processes
        (default: all of it here; FSDP2 ranks: ``DistributedEngine``)."""
        self.config = config or EngineConfig()
        self.parallel = parallel or OneProcess()
        self._merged = merged
        # in place (Module.to returns self). transformers wraps PreTrainedModel.to with
        # functools.wraps(nn.Module.to), which typeshed types as the unbound function: self first
        model.to(self.config.device)  # type: ignore[arg-type]
        self.model = model
        self.tokenizer = tokenizer
        if getattr(model.config, "final_logit_softcapping", None):
            raise InputError("model: final logit soft-capping is not supported by the fused head")
        if self.config.gradient_checkpointing:  # a critic's trunk is its HF model (no LM head)
            hf = model.trunk if isinstance(model, ValueModel) else model
            hf.activation_checkpointing_enable({"use_reentrant": False})
        self.model.train()  # dropout is 0 in the supported families; one mode for both passes
        self.subset = trainable is not None
        if trainable is None:
            named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        else:
            named = _check_trainable(self.model, trainable)
        self.param_names = [n for n, _ in named]
        # the optimizer's parameters: fp32 masters of bf16 ones, fp32 ones themselves
        self.masters = MasterWeights([p for _, p in named])
        self.params = self.masters.params
        self.optimizer = self._build_optimizer()
        self.step = 0
        # while asleep (colocation): the trainable weights by name and each one's optimizer
        # state tensors, in host memory; the live tensors are empty
        self.host_weights: dict[str, torch.Tensor] | None = None
        self._host_optim: list[dict[str, torch.Tensor]] = []
        embed: Any = self.model.get_input_embeddings()  # nn.Embedding, or a peft layer over one
        self.input_vocab_size = int(embed.num_embeddings)
        # a critic has a value head instead of the LM head, and trains the value objective
        self.is_critic = isinstance(self.model, ValueModel)
        self.objectives = VALUE_OBJECTIVES if self.is_critic else OBJECTIVES
        lm_head = self.model.get_output_embeddings()
        self.vocab_size = self.input_vocab_size if lm_head is None else int(lm_head.out_features)
        chunk = self.config.logprob_chunk_size
        self.chunk_size = auto_chunk_size(self.vocab_size) if chunk is None else chunk
        self.pad_token_id = int(getattr(model.config, "pad_token_id", None) or 0)

    @classmethod
    def from_pretrained(
        cls,
        spec: str | os.PathLike,
        config: EngineConfig | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> TrainingEngine:
        """An engine on a preset name, a local HF directory or a hub id.

        ``dtype`` is the model precision (keep fp32 on CPU: bf16 matmuls are emulated there);
        log-probs are computed in fp32 whatever it is."""
        model, tokenizer = load_model(spec, seed=seed, dtype=dtype)
        return cls(model, tokenizer, config)

    # ---------------------------------------------------------------- loss passes

    def run_loss(self, call: LossCall) -> ForwardResult:
        self._check_awake("forward_backward" if call.backward else "forward")
        valid = self.validate(call)
        lengths = [len(d) for d in call.datums]
        loss_sum, results = 0.0, []
        plan = self.parallel.microbatches(lengths, self.config.max_tokens_per_microbatch)
        # the pass accumulates into fresh gradients, added to the pending ones only once its
        # loss is known finite: a refused or failed pass leaves them as they were
        pending = self._set_aside_grads() if call.backward else None
        try:
            for k, group in enumerate(plan):
                if k:
                    turn_point()  # a shared server may run another tenant's unit here
                with self.parallel.around_microbatch():
                    total, outs = self.run_group(valid, group)
                loss_sum += total
                results += outs
            outputs, loss_sum = self.parallel.gather(loss_sum, results, len(call.datums))
            check_losses(valid.objective.name, outputs, loss_sum)  # same float on every rank
        except BaseException:
            if pending is not None:
                self._restore_grads(pending, keep_pass=False)
            raise
        if pending is not None:
            self._restore_grads(pending, keep_pass=True)
        return ForwardResult(outputs, call_metrics(call.datums, loss_sum))

    def _set_aside_grads(self) -> list[torch.Tensor | None]:
        """The pending gradients, taken off the parameters (while a pass runs on top of
        pending ones it holds a second set)."""
        pending = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return pending

    def _restore_grads(self, pending: list[torch.Tensor | None], keep_pass: bool) -> None:
        """``pending`` plus the pass's gradients (``keep_pass``), or ``pending`` alone."""
        for p, old in zip(self.params, pending, strict=True):
            new = p.grad if keep_pass else None
            p.grad = old if new is None else new if old is None else old.add_(new)

    def validate(self, call: LossCall) -> ValidCall:
        """Validate a whole request (nothing runs or changes before it passes)."""
        objective, config = validate_batch(
            call.datums,
            call.loss_fn,
            call.loss_fn_config,
            min(self.vocab_size, self.input_vocab_size),
            getattr(self.model.config, "max_position_embeddings", None),
            self.objectives,
        )
        t = call.temperature
        if not (isinstance(t, int | float) and t > 0):
            raise InputError(f"temperature: must be > 0, got {t!r}")
        supports = row_supports(call.datums, call.sampling_masks)
        routing = check_routing(self.model, call.datums, call.routed_experts)
        return ValidCall(call.datums, objective, config, t, call.backward, supports, routing)

    def run_group(self, call: ValidCall, group: Sequence[int]) -> tuple[float, Results]:
        """One microbatch of ``call``'s datums ``group``; ``PADDING`` slots (which keep ranks
        in step) run a one-token datum whose mask is 0."""
        pad = padding_datum(call.datums[0]) if PADDING in group else None
        datums = _slots(call.datums, group, pad)
        mb = collate(datums, group, call.objective.inputs, self.pad_token_id, self.config.device)
        supports = None
        if call.supports is not None:  # a padding datum is scored over the full vocabulary
            pad_rows = None if pad is None else row_supports([pad], [None])[0]
            supports = concat_supports(_slots(call.supports, group, pad_rows))
        forced = None
        if call.routing is not None:
            routes = [None if i == PADDING else call.routing[i] for i in group]
            forced = forced_rows(routes, mb.lengths, mb.input_ids.shape[1])
        return self.run_microbatch(
            mb, call.objective, call.config, call.temperature, call.backward, supports, forced
        )

    def run_microbatch(
        self,
        mb: Microbatch,
        objective: Objective,
        config: Mapping[str, float],
        temperature: float,
        backward: bool,
        supports: RowSupports | None = None,
        forced_routing: torch.Tensor | None = None,
    ) -> tuple[float, Results]:
        """One forward (and backward) pass; per-datum outputs come back in the return value."""
        # replay spans backward too: activation checkpointing re-runs the routers there
        with torch.set_grad_enabled(backward), replay_routing(self.model, forced_routing):
            hidden = self._hidden_rows(mb, shareable=forced_routing is None)
            loss = functools.partial(
                self._loss,
                mb=mb,
                objective=objective,
                config=config,
                temperature=temperature,
                supports=supports,
            )
            if backward and self.config.recompute_loss:
                total, lp, per_datum = checkpoint(loss, hidden, use_reentrant=False)
            else:
                total, lp, per_datum = loss(hidden)
            if backward:
                total.backward()
        lp_parts = lp.detach().cpu().split(mb.lengths)
        per_datum = per_datum.detach().cpu()
        name = objective.output  # logprobs, or a critic's values
        results = [
            (index, {name: lp_parts[j].clone(), "loss": per_datum[j].clone()})
            for j, index in enumerate(mb.indices)
            if index != PADDING
        ]
        return float(total.detach()), results

    def _hidden_rows(self, mb: Microbatch, shareable: bool = True) -> torch.Tensor:
        trunk = self._trunk()
        if self.config.share_prefixes and shareable and not self.config.gradient_checkpointing:
            plan = plan_prefixes(mb.input_ids, mb.lengths)
            if plan is not None:
                return shared_prefix_hidden(trunk, plan)
        batch, width = mb.input_ids.shape
        positions = torch.arange(width, device=mb.input_ids.device).expand(batch, width)
        hidden = trunk(mb.input_ids, mb.attention_mask, positions, None)
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, mb.rows)

    def _trunk(self) -> Trunk:
        """FastForward's decoder pass when it runs this model exactly (asked at every call:
        adapters, hooks or sharding may have been added since), else the HF decoder's. A peft
        model runs as the HF model its LoRA layers were injected into."""
        model = self.model.get_base_model() if isinstance(self.model, PeftModel) else self.model
        if (
            self.config.fast_forward
            and not self.config.gradient_checkpointing
            and FastForward.supports(model)
        ):
            return FastForward(model).hidden
        return functools.partial(_hf_trunk, self.model.get_decoder())

    def _loss(
        self,
        hidden: torch.Tensor,
        *,
        mb: Microbatch,
        objective: Objective,
        config: Mapping[str, float],
        temperature: float,
        supports: RowSupports | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head's per-row output (log-probs of the targets, or a critic's values), the
        objective's per-datum losses and their total."""
        model = self.model
        head: torch.nn.Module
        if isinstance(model, ValueModel):  # self.is_critic
            head = model.value_head
            lp = model.head_values(hidden)
        else:
            head = model.get_output_embeddings()  # not None: vocab_size came from it
            lp, _ = head_logprobs(
                hidden,
                head,
                mb.targets,
                temperature=temperature,
                chunk_size=self.chunk_size,
                supports=supports,
            )
        per_datum = datum_losses(
            objective, config, lp, mb.inputs, mb.mask, mb.segment, len(mb.indices)
        )
        if mb.has_loss_terms:
            total = per_datum.sum()
        else:  # only padding: an fp32 zero that keeps backward (and its collectives) running
            total = graph_connected_zero(head(hidden[:1]))
        return total, lp, per_datum

    # ---------------------------------------------------------------- optimizer

    def optim_step(self, adam_params: AdamParams | None = None) -> dict[str, float]:
        self._check_awake("optim_step")
        metrics = optimizer_step(self.params, self.optimizer, adam_params or AdamParams())
        if not metrics["skipped_nonfinite:sum"]:
            self.masters.publish()
            self.step += 1
        metrics["step:max"] = float(self.step)
        return metrics

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _build_optimizer(self) -> Any:
        return build_optimizer(
            self.model, self.params, self.config.optimizer, self.masters.model_params
        )

    # ---------------------------------------------------------------- state

    def save_state(self, path: StrPath, info: Info = None) -> Path:
        """Weights (the trainable subset, or the whole model) + optimizer state, atomically
        (temp dir + rename). ``info``: JSON values stored alongside, checked by ``load_state``."""
        self._check_awake("save_state")
        return ckpt.save_training_state(
            path,
            self.model,
            self.optimizer,
            self.param_names,
            self.step,
            params=self.params if self.subset else None,
            masters=None if self.subset else self.masters.by_name(self.param_names),
            info=info,
        )

    def load_state(self, path: StrPath, optimizer: bool = True, expect_info: Info = None) -> None:
        """Restore weights (and optimizer state): continuation is bit-identical.

        Everything (kind, ``expect_info`` against the saved info, names, shapes) is checked
        before anything changes."""
        self._check_awake("load_state")
        tensors, opt_tensors, meta = ckpt.read_training_state(path)
        ckpt.check_kind(meta, ckpt.KIND_PARAMS if self.subset else ckpt.KIND_MODEL)
        ckpt.check_info(meta, expect_info or {})
        if self.subset:
            ckpt.check_tensors(dict(zip(self.param_names, self.params, strict=True)), tensors)
        else:
            ckpt.check_model_tensors(self.model, tensors)
        opt_state = (
            ckpt.optimizer_state_dict(
                meta, opt_tensors, self.param_names, self.config.optimizer.kind
            )
            if optimizer
            else None
        )
        with torch.no_grad():
            if self.subset:
                ckpt.restore_params(self.param_names, self.params, tensors)
            else:
                ckpt.restore_model(self.model, tensors, meta["aliases"])
        self.masters.load(self.param_names, tensors)  # fp32 as saved, then rounded
        self.optimizer = self._build_optimizer()
        if opt_state is not None:
            self.optimizer.load_state_dict(opt_state)
        self.step = int(meta["step"]) if optimizer else 0

    def export_hf(self, path: StrPath) -> Path:
        """A normal HF directory that ``AutoModelForCausalLM.from_pretrained`` loads (an
        adapter merged into its base)."""
        self._check_awake("export_hf")
        if self.tokenizer is None:
            raise InputError("export_hf: the engine has no tokenizer to export")
        # a plain engine trains a causal LM (a critic's engine has no tokenizer: rl.critic), an
        # adapter's exports its merged model
        model = cast("PreTrainedModel", self.model) if self._merged is None else self._merged()
        return save_hf_dir(model, self.tokenizer, path)

    def weights(self) -> Mapping[str, torch.Tensor]:
        """What a rollout engine needs to sample like this trainer (``update_weights`` takes
        it): the trainable weights by name (from the host backup while asleep under
        colocation), or every weight of the merged model for an adapter."""
        if self.host_weights is not None:
            if self._merged is not None:
                raise InputError("weights: an adapter engine is asleep; wake() it to merge")
            return dict(self.host_weights)
        if self._merged is not None:  # the merged model's parameters, read without a copy
            from furlong.train.lora import merged_weights  # peft: only adapter engines need it

            return merged_weights(cast("PeftModel", self.model))  # merged: an adapter engine
        params = self.masters.model_params  # in the model's precision, as the rollout runs
        return {n: p.detach() for n, p in zip(self.param_names, params, strict=True)}

    # ---------------------------------------------------------------- colocation

    def sleep(self) -> int:
        """Copy the trainable parameters and the optimizer state to host memory and release
        their device storage, for a colocated rollout engine. While asleep ``host_weights``
        holds the weights by name (what to publish) and every pass raises. Returns the bytes
        moved."""
        if self.host_weights is not None:
            raise InputError("sleep: the engine is already asleep; wake() first")
        if any(p.grad is not None for p in self.params):
            raise InputError("sleep: gradients are pending; optim_step() or zero_grad() first")
        weights = {
            n: p.data.to("cpu", copy=True)
            for n, p in zip(self.param_names, self.params, strict=True)
        }
        optim = [
            {k: v.to("cpu", copy=True) for k, v in movable_state(self.optimizer, p).items()}
            for p in self.params
        ]
        for p in [*self.params, *(param for _, param in self.masters.pairs)]:
            p.data = p.data.new_empty(0)  # empty placeholders keep each dtype and device
            state = self.optimizer.state.get(p, {})
            for k, v in movable_state(self.optimizer, p).items():
                state[k] = v.new_empty(0)
        self.host_weights, self._host_optim = weights, optim
        self.clear_caches()
        return _nbytes(weights.values()) + sum(_nbytes(s.values()) for s in optim)

    def wake(self) -> int:
        """Restore exactly what :meth:`sleep` moved (bit-identical) and free the host backup.
        Returns the bytes moved."""
        if self.host_weights is None:
            raise InputError("wake: the engine is not asleep; sleep() first")
        moved = 0
        for n, p, saved in zip(self.param_names, self.params, self._host_optim, strict=True):
            p.data = self.host_weights[n].to(p.device)
            state = self.optimizer.state.get(p, {})
            for k, v in saved.items():
                state[k] = v.to(state[k].device)
            moved += self.host_weights[n].nbytes + _nbytes(saved.values())
        for master, param in self.masters.pairs:  # bf16 parameters: their masters rounded
            param.data = master.detach().to(param.dtype)
        self.host_weights, self._host_optim = None, []
        return moved

    def clear_caches(self) -> None:
        """Return the allocator's cached device blocks (CUDA), e.g. before a colocated engine
        loads its weights."""
        if torch.device(self.config.device).type == "cuda":
            torch.cuda.empty_cache()

    def _check_awake(self, where: str) -> None:
        if self.host_weights is not None:
            raise InputError(f"{where}: the engine is asleep (weights in host memory); wake first")


def _hf_trunk(
    decoder: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any,
) -> torch.Tensor:
    return decoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=cache is not None,
    ).last_hidden_state


def movable_state(optimizer: Any, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """``p``'s optimizer state tensors that ``sleep`` moves: file-backed (disk-store) state
    already lives off the device and stays where it is."""
    state = optimizer.state.get(p, {})  # get: indexing would add an empty entry
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not is_file_backed(v)}


def _slots(items: Sequence[T], group: Sequence[int], pad: T | None) -> list[T]:
    """``items[i]`` for each index ``i`` of ``group``, and ``pad`` (given when ``PADDING`` is
    in ``group``) at the ``PADDING`` slots."""
    out: list[T] = []
    for i in group:
        if i == PADDING:
            assert pad is not None  # made whenever the group has a padding slot
            out.append(pad)
        else:
            out.append(items[i])
    return out


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors)


def _check_trainable(
    model: torch.nn.Module, trainable: Sequence[tuple[str, torch.nn.Parameter]]
) -> list[tuple[str, torch.nn.Parameter]]:
    """Unique names, unique parameters, all of them the model's own."""
    named = list(trainable)
    own = {id(p) for p in model.parameters()}
    if not named:
        raise ValueError("trainable: no parameters")
    if len({n for n, _ in named}) != len(named) or len({id(p) for _, p in named}) != len(named):
        raise ValueError("trainable: names and parameters must be unique")
    stray = [n for n, p in named if id(p) not in own]
    if stray:
        raise ValueError(f"trainable: not parameters of the model: {stray[:5]}")
    return named
