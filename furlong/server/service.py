"""The service behind ``furlong serve``: sessions, training models, samplers and checkpoints,
with Tinker's semantics and no HTTP in sight (``app.py`` maps routes onto these methods).

Every training operation is queued on the model's :class:`CommandLog` (strict ``seq_id``
order) and runs on the shared :class:`ComputeLane`, which takes turns between tenants between
microbatches; every loss goes through the model's TrainingEngine. Samplers are embedded
rollout engines over frozen weight snapshots (a sampler keeps the weights it was made from
while training goes on), fed fairly across tenants by a :class:`FairFeeder`.

Hostile input is bounded before it is allocated: inflated body size, datums, tokens and dense
tensor elements per request (``proto.Limits``), prompt + ``max_tokens`` within the model's
context, and ``num_samples`` / ``max_tokens`` caps.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker import types as tt

from furlong.errors import InputError
from furlong.models.loading import remove_dir
from furlong.rollout.base import GenerateResult
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sampling import MAX_SEED, SamplingParams, fit_max_tokens
from furlong.server import proto
from furlong.server.compute_lane import ComputeLane
from furlong.server.futures import Failure, FutureStore
from furlong.server.models import LoraSpec, ModelPool, TrainingModel, sampling_model
from furlong.server.ordering import CommandLog
from furlong.server.sample_feeder import FairFeeder
from furlong.server.state import CheckpointRef, StateDir, check_name, iso_time
from furlong.train.dist_checkpoint import saved_optimizer_kind
from furlong.train.engine import EngineConfig
from furlong.train.optim import OptimizerConfig
from furlong.types import AdamParams

OPTIMIZERS = ("adamw", "muon")  # optimizer_config.type values this server trains with


class NotFound(KeyError):
    """Unknown (or another tenant's) session, model, sampler or checkpoint → HTTP 404."""


@dataclass(frozen=True)
class ServiceConfig:
    base_models: dict[str, str]  # served name -> preset or local HF dir
    state_dir: Path
    full_finetune: bool = False
    seed: int = 0
    max_datums: int = 4096
    max_tokens_per_datum: int = 32_768
    max_tensor_elements: int = 1 << 22  # one loss_fn_inputs tensor, once dense
    max_request_elements: int = 1 << 26  # all tensors of one forward_backward, once dense
    max_samples: int = 1024  # num_samples of one sample request
    max_sample_tokens: int = 4096  # max_tokens of one sample request (also <= the context)
    max_top_logprobs: int = 64  # topk_sample_logprobs / topk_prompt_logprobs
    poll_timeout: float = 25.0
    gap_timeout: float = 600.0
    max_seq_ahead: int = 1 << 14  # a seq_id further ahead of the next one is refused
    sampler_slots: int = 32
    snapshot_engines: int = 4  # sampler snapshots kept loaded for reuse (LRU)
    compress_fwdbwd: bool = False  # ask clients to zstd forward_backward bodies
    fwdbwd_max_chunk_len: int = 1024  # datums per forward_backward request (client-side split)
    trainer_ranks: int = 1  # > 1: full fine-tunes train on that many FSDP2 ranks (LoRA: 1)
    optimizer_state_dir: str | None = None  # every model's optimizer state on disk there


@dataclass
class _Model:
    owner: str
    log: CommandLog
    base_model: str
    lora: LoraSpec | None
    user_metadata: dict[str, Any] | None
    model: TrainingModel | None = None  # set by the creating operation (seq 0)
    last_request: float = field(default_factory=time.time)


@dataclass
class _Sampler:
    owner: str
    feeder: FairFeeder
    base_model: str
    model_path: str | None


@dataclass(frozen=True)
class DecodedFwdBwd:
    """A decoded ``forward_backward`` body: its model and ``seq_id``, and the request or why it
    was refused (a refusal still consumes the ``seq_id``)."""

    model_id: str
    seq_id: int
    request: proto.FwdBwdRequest | None
    error: InputError | None


class Service:
    def __init__(self, config: ServiceConfig):
        self.config = config
        self.state = StateDir(config.state_dir)
        self.pool = ModelPool(
            config.base_models,
            full_finetune=config.full_finetune,
            seed=config.seed,
            # absolute: clients load the tokenizer from this path, wherever they run
            tokenizer_root=Path(config.state_dir).resolve() / "tokenizers",
            trainer_ranks=config.trainer_ranks,
            engine_config=_engine_config(config),
        )
        self.futures = FutureStore(poll_timeout=config.poll_timeout)
        self.lane = ComputeLane()
        self.sessions: dict[str, str] = {}  # session id -> owner
        self.models: dict[str, _Model] = {}
        self.samplers: dict[str, _Sampler] = {}
        self._base_samplers: dict[str, FairFeeder] = {}
        self._snapshots: OrderedDict[Path, FairFeeder] = OrderedDict()
        self._snapshots_lock = threading.Lock()  # HTTP, compute and threadpool threads share it

    # ---------------------------------------------------------------- sessions

    def create_session(self, owner: str) -> str:
        session_id = f"s{uuid.uuid4().hex[:12]}"
        self.sessions[session_id] = owner
        return session_id

    def _session(self, owner: str, session_id: str) -> None:
        if self.sessions.get(session_id) != owner:
            raise NotFound(f"session {session_id!r}")

    # ---------------------------------------------------------------- models

    def create_model(self, owner: str, req: tt.CreateModelRequest) -> str:
        self._session(owner, req.session_id)
        lora = self._lora(req.lora_config)
        self._check_base(req.base_model)
        optimizer = _optimizer_kind(req.optimizer_config)
        model_id = self._new_model_id(req.session_id, req.model_seq_id)
        entry = self._register(owner, model_id, req.base_model, lora, req.user_metadata)

        def create() -> dict:
            entry.model = self.pool.create(model_id, req.base_model, lora, optimizer=optimizer)
            self._write_run(model_id, entry)
            return {"model_id": model_id, "type": "create_model"}

        return entry.log.submit(0, create)

    def _new_model_id(self, session_id: str, model_seq_id: int) -> str:
        if model_seq_id < 0:
            raise InputError(f"model_seq_id: must be >= 0, got {model_seq_id}")
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.models:
            raise InputError(f"model_seq_id: {model_seq_id} already used in this session")
        return model_id

    def _lora(self, config: tt.LoraConfig | None) -> LoraSpec | None:
        if config is None:
            if not self.config.full_finetune:
                raise InputError("lora_config: required (start the server with --full-finetune)")
            return None
        if config.rank <= 0:
            raise InputError(f"lora_config.rank: must be >= 1, got {config.rank}")
        return LoraSpec(
            rank=config.rank,
            train_mlp=config.train_mlp,
            train_attn=config.train_attn,
            train_unembed=config.train_unembed,
            seed=config.seed,
        )

    def _check_base(self, name: str) -> None:
        if name not in self.pool.names():
            raise InputError(f"base_model: {name!r} is not served; served: {self.pool.names()}")

    def _register(self, owner, model_id, base_model, lora, user_metadata) -> _Model:
        log = CommandLog(
            self.futures,
            self.lane.executor(owner),
            owner,
            first_seq=0,
            gap_timeout=self.config.gap_timeout,
            max_ahead=self.config.max_seq_ahead,
        )
        entry = _Model(owner, log, base_model, lora, user_metadata)
        self.models[model_id] = entry
        return entry

    def _write_run(self, model_id: str, entry: _Model) -> None:
        assert entry.model is not None
        self.state.write_run(
            model_id,
            {
                "base_model": entry.base_model,
                "owner": entry.owner,
                "is_lora": entry.model.is_lora,
                "lora_config": entry.model.lora_config(),
                "user_metadata": entry.user_metadata,
                "created": time.time(),
            },
        )

    def _model(self, owner: str, model_id: str) -> _Model:
        entry = self.models.get(model_id)
        if entry is None or entry.owner != owner:
            raise NotFound(f"model {model_id!r}")
        entry.last_request = time.time()
        return entry

    def _ready(self, entry: _Model) -> TrainingModel:
        if entry.model is None:  # creation failed (its future says why)
            raise InputError("model_id: the model could not be created")
        return entry.model

    def get_info(self, owner: str, model_id: str) -> dict:
        entry = self._model(owner, model_id)
        lora = entry.lora
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": "furlong",
                "model_name": entry.base_model,
                "tokenizer_id": str(self.pool.tokenizer_dir(entry.base_model).resolve()),
            },
            "is_lora": lora is not None,
            "lora_rank": None if lora is None else lora.rank,
            "model_name": entry.base_model,
        }

    # ---------------------------------------------------------------- training ops

    def _submit(
        self,
        owner: str,
        model_id: str,
        seq_id: int | None,
        fingerprint: bytes,
        prepare: Callable[[_Model], Callable[[], Any]],
    ) -> str:
        """Queue the operation ``prepare`` validates and returns; a refusal still consumes the
        model's ``seq_id`` (recorded as failed), so its next operation never waits for it."""
        entry = self._model(owner, model_id)
        seq = _seq(seq_id)
        known = entry.log.replay(seq, fingerprint)
        if known is not None:
            return known
        try:
            op = prepare(entry)
        except (InputError, NotFound) as exc:
            entry.log.refuse(seq, exc, fingerprint)
            raise
        return entry.log.submit(seq, op, fingerprint)

    def refuse(self, owner: str, fields: dict[str, Any], error: Exception, fingerprint: bytes):
        """A seq-numbered request whose body failed validation: consume its ``seq_id`` when the
        body still names one of this owner's models and a usable ``seq_id``."""
        model_id, seq_id = fields.get("model_id"), fields.get("seq_id")
        entry = self.models.get(model_id) if isinstance(model_id, str) else None
        if entry is None or entry.owner != owner:
            return
        if isinstance(seq_id, int) and not isinstance(seq_id, bool) and seq_id >= 1:
            entry.log.refuse(seq_id, error, fingerprint)

    def limits(self, max_bytes: int | None) -> proto.Limits:
        c = self.config
        return proto.Limits(
            max_bytes=max_bytes,
            max_datums=c.max_datums,
            max_tokens_per_datum=c.max_tokens_per_datum,
            max_tensor_elements=c.max_tensor_elements,
            max_request_elements=c.max_request_elements,
            zstd=c.compress_fwdbwd,
        )

    def decode_forward_backward(
        self, body: bytes, encoding: str | None, max_bytes: int | None = None
    ) -> DecodedFwdBwd:
        """Inflate, decode and convert a body within the limits (CPU work: call it off the
        event loop). Body-level errors raise; a datum-level error is kept for ``forward_backward``
        so the refusal can consume the request's ``seq_id``."""
        limits = self.limits(max_bytes)
        msg = proto.decode_forward_backward(body, encoding, limits)
        try:
            request = proto.convert_forward_backward(msg, limits)
        except InputError as exc:
            return DecodedFwdBwd(msg.model_id, msg.seq_id, None, exc)
        return DecodedFwdBwd(msg.model_id, msg.seq_id, request, None)

    def forward_backward(self, owner: str, decoded: DecodedFwdBwd, fingerprint: bytes) -> str:
        def prepare(entry: _Model) -> Callable[[], bytes]:
            if decoded.error is not None:
                raise decoded.error
            req = decoded.request
            assert req is not None

            def run() -> bytes:
                model = self._ready(entry)
                result = model.forward_backward(
                    req.data, req.loss_fn, req.loss_fn_config, req.forward_only
                )
                return proto.encode_forward_backward_output(result)

            return run

        return self._submit(owner, decoded.model_id, decoded.seq_id, fingerprint, prepare)

    def optim_step(self, owner: str, req: tt.OptimStepRequest, fingerprint: bytes = b"") -> str:
        def prepare(entry: _Model) -> Callable[[], dict]:
            params = req.optim_params
            if not isinstance(params, tt.AdamParams):  # Muon models take AdamParams too
                raise InputError(
                    f"optimizer_params.type: {params.type!r} is not supported; send "
                    "adam_params (AdamW and Muon models both take them)"
                )
            adam = AdamParams(**params.model_dump(exclude={"type"}))

            def run() -> dict:
                metrics = self._ready(entry).optim_step(adam)
                # JSON has no NaN: a vetoed step's norm is left out (skipped_nonfinite:sum says
                # why), so the SDK's response model still validates
                return {"metrics": _finite(metrics), "type": "optim_step"}

            return run

        return self._submit(owner, req.model_id, req.seq_id, fingerprint, prepare)

    def save_weights(self, owner: str, req: tt.SaveWeightsRequest, fingerprint: bytes = b"") -> str:
        def prepare(entry: _Model) -> Callable[[], dict]:
            name = check_name(_name_or_stamp(req.path), "path")
            ref = CheckpointRef(req.model_id, "weights", name)

            def run() -> dict:
                self._ready(entry).save_state(self.state.checkpoint_dir(ref))
                return {"path": ref.uri, "type": "save_weights"}

            return run

        return self._submit(owner, req.model_id, req.seq_id, fingerprint, prepare)

    def save_weights_for_sampler(
        self, owner: str, req: tt.SaveWeightsForSamplerRequest, fingerprint: bytes = b""
    ) -> str:
        session = req.sampling_session_seq_id

        def prepare(entry: _Model) -> Callable[[], dict]:
            if req.path is None and session is None:
                raise InputError("path: give a name or a sampling_session_seq_id")
            name = check_name(_name_or_stamp(req.path, "sampler-"), "path")
            ref = CheckpointRef(req.model_id, "sampler_weights", name)

            def run() -> dict:
                path = self.state.checkpoint_dir(ref)
                self._ready(entry).save_sampler_weights(path)
                self._forget_snapshot(path)
                if session is None:
                    return {"path": ref.uri, "type": "save_weights_for_sampler"}
                sampler_id = self._new_sampler(owner, entry.base_model, ref.uri)
                return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

            return run

        return self._submit(owner, req.model_id, req.seq_id, fingerprint, prepare)

    def load_weights(self, owner: str, req: tt.LoadWeightsRequest, fingerprint: bytes = b"") -> str:
        if req.session_id is None:  # mode A: into an existing model, in seq order

            def prepare(entry: _Model) -> Callable[[], dict]:
                ref, source = self._loadable(owner, req.path)

                def load() -> dict:
                    self._ready(entry).load_state(source, optimizer=req.optimizer)
                    return {"path": ref.uri, "type": "load_weights"}

                return load

            return self._submit(owner, req.model_id or "", req.seq_id, fingerprint, prepare)
        ref, source = self._loadable(owner, req.path)
        # mode B: create-via-load; the load is the new model's operation 0
        self._session(owner, req.session_id)
        meta = self.state.read_run(ref.run_id) or {}
        base = req.base_model or meta["base_model"]
        self._check_base(base)
        lora_cfg = meta.get("lora_config") or {}
        lora = LoraSpec(**lora_cfg) if lora_cfg else None
        # with its optimizer state a model keeps the checkpoint's optimizer
        optimizer = (
            saved_optimizer_kind(source)  # a single-process or a multi-rank (DCP) checkpoint
            if req.optimizer
            else _optimizer_kind(req.optimizer_config)
        )
        model_id = self._new_model_id(req.session_id, req.model_seq_id)
        entry = self._register(owner, model_id, base, lora, req.user_metadata)

        def create_and_load() -> dict:
            model = self.pool.create(model_id, base, lora, optimizer=optimizer)
            try:
                model.load_state(source, optimizer=req.optimizer)
            except BaseException:
                self.pool.remove(model_id)
                raise
            entry.model = model
            self._write_run(model_id, entry)
            return {"model_id": model_id, "path": ref.uri, "type": "load_weights"}

        return entry.log.submit(0, create_and_load)

    def _loadable(self, owner: str, path: str) -> tuple[CheckpointRef, Path]:
        ref = CheckpointRef.parse(path)
        if ref.segment != "weights":
            raise InputError(f"path: {path!r} is a sampler snapshot; load a weights/ path")
        return ref, self._checkpoint(owner, ref)

    def _checkpoint(self, owner: str, ref: CheckpointRef) -> Path:
        meta = self.state.read_run(ref.run_id)
        path = self.state.checkpoint_dir(ref)
        if meta is None or meta.get("owner") != owner or not path.is_dir():
            raise NotFound(f"checkpoint {ref.uri!r}")
        return path

    # ---------------------------------------------------------------- sampling

    def create_sampling_session(self, owner: str, req: tt.CreateSamplingSessionRequest) -> str:
        self._session(owner, req.session_id)
        if req.model_path:
            ref = CheckpointRef.parse(req.model_path, "model_path")
            if ref.segment != "sampler_weights":
                raise InputError(
                    "model_path: sample from a sampler_weights/ path "
                    "(save_weights_for_sampler), not a training-state path"
                )
            base = (self.state.read_run(ref.run_id) or {}).get("base_model", "")
            return self._new_sampler(owner, base, ref.uri)
        if not req.base_model:
            raise InputError("base_model: required when no model_path is given")
        self._check_base(req.base_model)
        return self._new_sampler(owner, req.base_model, None)

    def _new_sampler(self, owner: str, base_model: str, model_path: str | None) -> str:
        feeder = self._feeder(owner, base_model, model_path)
        sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        self.samplers[sampler_id] = _Sampler(owner, feeder, base_model, model_path)
        return sampler_id

    def _feeder(self, owner: str, base_model: str, model_path: str | None) -> FairFeeder:
        """The fair feeder of a rollout engine over a base model (one per base, shared by every
        tenant) or over a sampler snapshot."""
        if model_path is None:
            feeder = self._base_samplers.get(base_model)
            if feeder is None:
                model, tokenizer = self.pool.base(base_model)
                feeder = self._new_feeder(model, tokenizer)
                self._base_samplers[base_model] = feeder
            return feeder
        path = self._checkpoint(owner, CheckpointRef.parse(model_path))
        with self._snapshots_lock:
            feeder = self._snapshots.pop(path, None)
            if feeder is None:  # a snapshot changes only when re-saved, which evicts it
                feeder = self._new_feeder(*sampling_model(self.pool, path))
            self._snapshots[path] = feeder
            while len(self._snapshots) > self.config.snapshot_engines:
                self._snapshots.popitem(last=False)  # live samplers keep their own reference
            return feeder

    def _new_feeder(self, model: Any, tokenizer: Any) -> FairFeeder:
        return FairFeeder(EmbeddedEngine(model, tokenizer, max_running=self.config.sampler_slots))

    def _forget_snapshot(self, path: Path) -> None:
        with self._snapshots_lock:
            self._snapshots.pop(path, None)

    def sampler_info(self, owner: str, sampler_id: str) -> dict:
        s = self._sampler(owner, sampler_id)
        return {"sampler_id": sampler_id, "base_model": s.base_model, "model_path": s.model_path}

    def _sampler(self, owner: str, sampler_id: str) -> _Sampler:
        s = self.samplers.get(sampler_id)
        if s is None or s.owner != owner:
            raise NotFound(f"sampler {sampler_id!r}")
        return s

    def sample(self, owner: str, req: tt.SampleRequest) -> tuple[str, list[str]]:
        """Queue ``num_samples`` sequences; returns the request id and the sequence ids."""
        if req.sampling_session_id:
            feeder = self._sampler(owner, req.sampling_session_id).feeder
        else:  # legacy addressing: no sampling session is registered
            if not req.model_path:
                self._check_base(req.base_model or "")
            feeder = self._feeder(owner, req.base_model or "", req.model_path)
        for name in ("prompt_alt_tokens_k", "target_prompt_logprobs", "record_stability_info"):
            if getattr(req, name, None):
                raise InputError(f"{name}: not supported by furlong")
        if not 1 <= req.num_samples <= self.config.max_samples:
            raise InputError(
                f"num_samples: must be in [1, {self.config.max_samples}], got {req.num_samples}"
            )
        top = self.config.max_top_logprobs
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
            k = getattr(req, name)
            if not 0 <= k <= top:  # each is k entries per token of every sequence returned
                raise InputError(f"{name}: must be in [0, {top}], got {k}")
        if (top_k := req.sampling_params.top_k) < -1:
            raise InputError(f"sampling_params.top_k: -1 or 0 (no limit) or >= 1, got {top_k}")
        prompt = _tokens(req.prompt, "prompt")
        scored_from = _prompt_scored_from(req, len(prompt))
        params = self._sampling_params(req, len(prompt), feeder.engine)
        futures = feeder.submit(owner, [prompt] * req.num_samples, params)  # checked whole
        request_id = self.futures.create(owner)

        def done(_f: Any) -> None:
            if all(f.done() for f in futures):
                self.futures.resolve(request_id, _sample_result(futures, scored_from))

        for f in futures:
            f.add_done_callback(done)
        return request_id, [f"{request_id}-{i}" for i in range(req.num_samples)]

    def _sampling_params(
        self, req: tt.SampleRequest, prompt_len: int, engine: EmbeddedEngine
    ) -> list[SamplingParams]:
        sp = req.sampling_params
        max_tokens = fit_max_tokens(
            sp.max_tokens,
            prompt_len,
            engine.context_length,
            self.config.max_sample_tokens,
            "sampling_params.max_tokens",
        )
        if sp.seed is not None and not 0 <= sp.seed <= MAX_SEED - (req.num_samples - 1):
            raise InputError(  # sample i draws with seed + i
                f"sampling_params.seed: must be in [0, 2**64 - num_samples], got {sp.seed}"
            )
        stop_ids: tuple[int, ...] | None = None
        stop_strings: tuple[str, ...] = ()
        if sp.stop is not None:
            stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop)
            if all(isinstance(s, int) for s in stops):
                stop_ids = tuple(stops)  # [] -> never stop, not even at EOS
                for j, t in enumerate(stop_ids):  # an id outside could never end a sequence
                    if not 0 <= t < engine.vocab_size:
                        raise InputError(
                            f"sampling_params.stop[{j}]: token id {t} outside "
                            f"[0, {engine.vocab_size})"
                        )
            elif all(isinstance(s, str) for s in stops):
                stop_strings = tuple(stops)
            else:
                raise InputError("sampling_params.stop: mixes strings and token ids")
        base = dict(
            max_tokens=max_tokens,
            temperature=sp.temperature,
            top_k=sp.top_k if sp.top_k > 0 else 0,
            top_p=sp.top_p,
            stop_token_ids=stop_ids,
            stop=stop_strings,
            top_logprobs=req.topk_sample_logprobs,
        )
        return [
            SamplingParams(  # checks and names the remaining fields
                **base,
                seed=None if sp.seed is None else sp.seed + i,
                prompt_logprobs=bool(req.prompt_logprobs) and i == 0,
                prompt_top_logprobs=req.topk_prompt_logprobs if i == 0 else 0,
            )
            for i in range(req.num_samples)
        ]

    # ---------------------------------------------------------------- runs and checkpoints

    def training_runs(self, owner: str) -> list[dict]:
        return [
            self._run_record(run_id, meta)
            for run_id, meta in self.state.runs()
            if meta.get("owner") == owner
        ]

    def training_run(self, owner: str, run_id: str) -> dict:
        meta = self.state.read_run(run_id)
        if meta is None or meta.get("owner") != owner:
            raise NotFound(f"training run {run_id!r}")
        return self._run_record(run_id, meta)

    def _run_record(self, run_id: str, meta: dict) -> dict:
        checkpoints = self.state.checkpoints(run_id)
        training = [c for c in checkpoints if c["checkpoint_type"] == "training"]
        sampler = [c for c in checkpoints if c["checkpoint_type"] == "sampler"]
        lora = meta.get("lora_config") or {}
        return {
            "training_run_id": run_id,
            "base_model": meta["base_model"],
            "model_owner": meta["owner"],
            "is_lora": bool(meta.get("is_lora")),
            "lora_rank": lora.get("rank"),
            "last_request_time": iso_time(meta.get("created", 0.0)),
            "last_checkpoint": training[-1] if training else None,
            "last_sampler_checkpoint": sampler[-1] if sampler else None,
            "user_metadata": _str_dict(meta.get("user_metadata")),
        }

    def checkpoints(self, owner: str, run_id: str) -> list[dict]:
        self.training_run(owner, run_id)
        return self.state.checkpoints(run_id)

    def delete_checkpoint(self, owner: str, run_id: str, segment: str, name: str) -> None:
        ref = CheckpointRef.parse(f"tinker://{run_id}/{segment}/{name}")
        path = self._checkpoint(owner, ref)
        self._forget_snapshot(path)
        remove_dir(path)

    def weights_info(self, owner: str, tinker_path: str) -> dict:
        ref = CheckpointRef.parse(tinker_path, "tinker_path")
        self._checkpoint(owner, ref)
        meta = self.state.read_run(ref.run_id) or {}
        lora = meta.get("lora_config") or {}
        return {
            "base_model": meta["base_model"],
            "is_lora": bool(meta.get("is_lora")),
            "lora_rank": lora.get("rank"),
            "train_unembed": lora.get("train_unembed"),
            "train_mlp": lora.get("train_mlp"),
            "train_attn": lora.get("train_attn"),
        }

    def capabilities(self) -> dict:
        return {
            "supported_models": [
                {
                    "model_name": name,
                    "max_context_length": self.pool.context_length(name),
                    "trainable": True,
                    "sampleable": True,
                }
                for name in self.pool.names()
            ]
        }


def _engine_config(config: ServiceConfig) -> EngineConfig:
    """The pool's engine settings: optimizer state in file-backed mappings on request."""
    if config.optimizer_state_dir is None:
        return EngineConfig()
    store = OptimizerConfig(state_store="disk", disk_dir=config.optimizer_state_dir)
    return EngineConfig(optimizer=store)


def _optimizer_kind(config: Any) -> str:
    """``optimizer_config``: ``{"type": "adamw"}`` (the default) or ``{"type": "muon"}`` (the
    SDK's ``OptimizerConfigBase(type="muon")``); Tinker's ``dimuon`` is not implemented."""
    if config is None:
        return "adamw"
    kind = getattr(config, "type", None)
    if kind not in OPTIMIZERS:
        raise InputError(
            f"optimizer_config.type: {kind!r} is not supported; this server trains with "
            f"{' or '.join(map(repr, OPTIMIZERS))}"
        )
    extra = sorted(set(config.model_dump()) - {"type"})
    if extra:
        raise InputError(f"optimizer_config.{extra[0]}: not supported for {kind!r}")
    return kind


def _seq(seq_id: int | None) -> int:
    if not isinstance(seq_id, int) or isinstance(seq_id, bool) or seq_id < 1:
        raise InputError(f"seq_id: expected an integer >= 1, got {seq_id!r}")
    return seq_id


def fingerprint(body: bytes) -> bytes:
    """What a retry must repeat: the body's digest (a different body is a conflict)."""
    return hashlib.sha256(body).digest()


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


def _tokens(model_input: tt.ModelInput, field_name: str) -> list[int]:
    tokens: list[int] = []
    for j, chunk in enumerate(model_input.chunks):
        if getattr(chunk, "type", None) != "encoded_text":
            raise InputError(f"{field_name}.chunks[{j}]: only encoded_text chunks are supported")
        tokens.extend(int(t) for t in chunk.tokens)
    if not tokens:
        raise InputError(f"{field_name}: empty")
    return tokens


def _prompt_scored_from(req: tt.SampleRequest, prompt_len: int) -> int:
    """The first prompt position whose log-probs are returned (``prompt_logprobs_last_n``)."""
    last_n = req.prompt_logprobs_last_n
    if last_n is None:
        return 1
    if not req.prompt_logprobs:
        raise InputError("prompt_logprobs_last_n: requires prompt_logprobs")
    if not 1 <= last_n <= prompt_len - 1:
        raise InputError(
            f"prompt_logprobs_last_n: must be in [1, {prompt_len - 1}] for this prompt, "
            f"got {last_n}"
        )
    return prompt_len - last_n


def _sample_result(futures: list, scored_from: int) -> Any:
    try:
        results: list[GenerateResult] = [f.result() for f in futures]
    except InputError as e:
        return Failure(str(e), "user")
    except Exception as e:  # noqa: BLE001 - reported to the client, not raised in a callback
        return Failure(f"{type(e).__name__}: {e}", "server")
    sequences = [
        proto.SampledSeq(
            tokens=r.output_ids,
            logprobs=r.output_logprobs,
            stop_reason="length" if r.finish_reason == "length" else "stop",
            topk=r.top_logprobs,
        )
        for r in results
    ]
    first = results[0]
    prompt_lp, prompt_top = first.prompt_logprobs, first.prompt_top_logprobs
    if prompt_lp is not None:
        prompt_lp = [None] * scored_from + prompt_lp[scored_from:]
    if prompt_top is not None:
        prompt_top = [None] * scored_from + prompt_top[scored_from:]
    return proto.encode_sample_response(sequences, prompt_lp, prompt_top)


def _name_or_stamp(name: str | None, prefix: str = "") -> str:
    """The client's name (an empty one is refused by ``check_name``) or a fresh stamp."""
    return f"{prefix}{_stamp()}" if name is None else name


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + f"-{uuid.uuid4().hex[:6]}"


def _str_dict(d: Any) -> dict[str, str] | None:
    return None if not d else {str(k): str(v) for k, v in d.items()}
