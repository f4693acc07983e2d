"""The service behind ``furlong serve``: sessions, training models, samplers and checkpoints,
with Tinker's semantics and no HTTP in sight (``app.py`` maps routes onto these methods).

Every training operation is queued on the model's :class:`CommandLog` (strict ``seq_id``
order) and runs on one compute thread; every loss goes through the model's TrainingEngine.
Samplers are embedded rollout engines over frozen weight snapshots, so a sampler keeps the
weights it was made from while training goes on.
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker import types as tt

from furlong.errors import InputError
from furlong.rollout.base import GenerateResult
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sampling import SamplingParams
from furlong.server import proto
from furlong.server.futures import Failure, FutureStore
from furlong.server.models import LoraSpec, ModelPool, TrainingModel, sampling_model
from furlong.server.ordering import CommandLog
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
    poll_timeout: float = 25.0
    gap_timeout: float = 600.0
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
    engine: EmbeddedEngine
    base_model: str
    model_path: str | None


class Service:
    def __init__(self, config: ServiceConfig):
        self.config = config
        self.state = StateDir(config.state_dir)
        self.pool = ModelPool(
            config.base_models,
            full_finetune=config.full_finetune,
            seed=config.seed,
            tokenizer_root=Path(config.state_dir) / "tokenizers",
            trainer_ranks=config.trainer_ranks,
            engine_config=_engine_config(config),
        )
        self.futures = FutureStore(poll_timeout=config.poll_timeout)
        self.compute = ThreadPoolExecutor(1, thread_name_prefix="furlong-train")
        self.sessions: dict[str, str] = {}  # session id -> owner
        self.models: dict[str, _Model] = {}
        self.samplers: dict[str, _Sampler] = {}
        self._base_samplers: dict[str, EmbeddedEngine] = {}
        self._snapshots: OrderedDict[Path, EmbeddedEngine] = OrderedDict()
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
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        if model_id in self.models:
            raise InputError(f"model_seq_id: {req.model_seq_id} already used in this session")
        entry = self._register(owner, model_id, req.base_model, lora, req.user_metadata)

        def create() -> dict:
            entry.model = self.pool.create(model_id, req.base_model, lora, optimizer=optimizer)
            self._write_run(model_id, entry)
            return {"model_id": model_id, "type": "create_model"}

        return entry.log.submit(0, create)

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
        log = CommandLog(self.futures, self.compute, owner, 0, self.config.gap_timeout)
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
                "tokenizer_id": str(self.pool.tokenizer_dir(entry.base_model)),
            },
            "is_lora": lora is not None,
            "lora_rank": None if lora is None else lora.rank,
            "model_name": entry.base_model,
        }

    # ---------------------------------------------------------------- training ops

    def forward_backward(self, owner: str, body: bytes, encoding: str | None) -> str:
        req = proto.parse_forward_backward(body, encoding)
        entry = self._model(owner, req.model_id)
        if len(req.data) > self.config.max_datums:
            raise InputError(f"data: {len(req.data)} datums; the limit is {self.config.max_datums}")
        for i, d in enumerate(req.data):
            if len(d) > self.config.max_tokens_per_datum:
                raise InputError(
                    f"data[{i}].model_input: {len(d)} tokens; the limit is "
                    f"{self.config.max_tokens_per_datum}"
                )

        def run() -> bytes:
            model = self._ready(entry)
            result = model.forward_backward(
                req.data, req.loss_fn, req.loss_fn_config, req.forward_only
            )
            return proto.encode_forward_backward_output(result)

        return entry.log.submit(req.seq_id, run)

    def optim_step(self, owner: str, req: tt.OptimStepRequest) -> str:
        entry = self._model(owner, req.model_id)
        params = req.optim_params

        def run() -> dict:
            # rejected in its turn: a refusal at submission would leave a seq_id gap that
            # stalls every later operation of the model until gap_timeout
            if not isinstance(params, tt.AdamParams):  # Muon models take AdamParams too
                raise InputError(
                    f"optimizer_params.type: {params.type!r} is not supported; send "
                    "adam_params (AdamW and Muon models both take them)"
                )
            adam = AdamParams(**params.model_dump(exclude={"type"}))
            return {"metrics": self._ready(entry).optim_step(adam), "type": "optim_step"}

        return entry.log.submit(_seq(req.seq_id), run)

    def save_weights(self, owner: str, req: tt.SaveWeightsRequest) -> str:
        entry = self._model(owner, req.model_id)
        ref = CheckpointRef(req.model_id, "weights", check_name(req.path or _stamp(), "path"))

        def run() -> dict:
            self._ready(entry).save_state(self.state.checkpoint_dir(ref))
            return {"path": ref.uri, "type": "save_weights"}

        return entry.log.submit(_seq(req.seq_id), run)

    def save_weights_for_sampler(self, owner: str, req: tt.SaveWeightsForSamplerRequest) -> str:
        entry = self._model(owner, req.model_id)
        session = req.sampling_session_seq_id
        name = check_name(req.path, "path") if req.path else f"sampler-{_stamp()}"
        if req.path is None and session is None:
            raise InputError("path: give a name or a sampling_session_seq_id")
        ref = CheckpointRef(req.model_id, "sampler_weights", name)

        def run() -> dict:
            path = self.state.checkpoint_dir(ref)
            self._ready(entry).save_sampler_weights(path)
            self._forget_snapshot(path)
            if session is None:
                return {"path": ref.uri, "type": "save_weights_for_sampler"}
            sampler_id = self._new_sampler(owner, entry.base_model, ref.uri)
            return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

        return entry.log.submit(_seq(req.seq_id), run)

    def load_weights(self, owner: str, req: tt.LoadWeightsRequest) -> str:
        ref = CheckpointRef.parse(req.path)
        if ref.segment != "weights":
            raise InputError(f"path: {req.path!r} is a sampler snapshot; load a weights/ path")
        source = self._checkpoint(owner, ref)
        if req.session_id is None:  # mode A: into an existing model, in seq order
            entry = self._model(owner, req.model_id or "")

            def load() -> dict:
                self._ready(entry).load_state(source, optimizer=req.optimizer)
                return {"path": ref.uri, "type": "load_weights"}

            return entry.log.submit(_seq(req.seq_id), load)
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
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        if model_id in self.models:
            raise InputError(f"model_seq_id: {req.model_seq_id} already used in this session")
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
        engine = self._engine(owner, base_model, model_path)
        sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        self.samplers[sampler_id] = _Sampler(owner, engine, base_model, model_path)
        return sampler_id

    def _engine(self, owner: str, base_model: str, model_path: str | None) -> EmbeddedEngine:
        """A rollout engine over a base model (one per base, shared) or a sampler snapshot."""
        if model_path is None:
            engine = self._base_samplers.get(base_model)
            if engine is None:
                model, tokenizer = self.pool.base(base_model)
                engine = EmbeddedEngine(model, tokenizer, max_running=self.config.sampler_slots)
                self._base_samplers[base_model] = engine
            return engine
        path = self._checkpoint(owner, CheckpointRef.parse(model_path))
        with self._snapshots_lock:
            engine = self._snapshots.pop(path, None)
            if engine is None:  # a snapshot changes only when re-saved, which evicts it
                model, tokenizer = sampling_model(self.pool, path)
                engine = EmbeddedEngine(model, tokenizer, max_running=self.config.sampler_slots)
            self._snapshots[path] = engine
            while len(self._snapshots) > self.config.snapshot_engines:
                self._snapshots.popitem(last=False)  # live samplers keep their own reference
            return engine

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
            engine = self._sampler(owner, req.sampling_session_id).engine
        else:  # legacy addressing: no sampling session is registered
            if not req.model_path:
                self._check_base(req.base_model or "")
            engine = self._engine(owner, req.base_model or "", req.model_path)
        for name in ("prompt_alt_tokens_k", "target_prompt_logprobs", "record_stability_info"):
            if getattr(req, name, None):
                raise InputError(f"{name}: not supported by furlong")
        if req.num_samples < 1:
            raise InputError(f"num_samples: must be >= 1, got {req.num_samples}")
        if req.topk_prompt_logprobs < 0:
            raise InputError(f"topk_prompt_logprobs: must be >= 0, got {req.topk_prompt_logprobs}")
        prompt = _tokens(req.prompt, "prompt")
        scored_from = _prompt_scored_from(req, len(prompt))
        params = self._sampling_params(req, len(prompt), engine)
        futures = engine.submit_many([prompt] * req.num_samples, params)
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
        context = int(getattr(engine.model.config, "max_position_embeddings", 4096))
        max_tokens = sp.max_tokens if sp.max_tokens is not None else context - prompt_len
        stop_ids: tuple[int, ...] | None = None
        stop_strings: tuple[str, ...] = ()
        if sp.stop is not None:
            stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop)
            if all(isinstance(s, int) for s in stops):
                stop_ids = tuple(stops)  # [] -> never stop, not even at EOS
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
            SamplingParams(
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
        shutil.rmtree(path)

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
                {"model_name": name, "trainable": True, "sampleable": True}
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
    if seq_id is None or seq_id < 1:
        raise InputError(f"seq_id: expected an integer >= 1, got {seq_id!r}")
    return seq_id


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


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + f"-{uuid.uuid4().hex[:6]}"


def _str_dict(d: Any) -> dict[str, str] | None:
    return None if not d else {str(k): str(v) for k, v in d.items()}
