"""Training runs of the Tinker service: each client ``model_id`` (``<session>:train:<n>``, also
its run id on disk) with its :class:`CommandLog` and, once operation 0 created it, the
:class:`TrainingModel` (models.py) that holds its trainable weights on a served ``base_model``.

Every operation on a run is queued on its log (strict ``seq_id`` order) and runs on the shared
:class:`ComputeLane`, which takes turns between tenants between microbatches; a request refused
at submission still consumes its ``seq_id``. Checkpoint operations (runs.py) queue through
:meth:`TrainingRuns.submit` too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from tinker import types as tt

from furlong.errors import InputError
from furlong.server import proto
from furlong.server.compute_lane import ComputeLane
from furlong.server.futures import FutureStore
from furlong.server.models import LoraSpec, ModelPool, TrainingModel
from furlong.server.ordering import CommandLog
from furlong.server.sessions import NotFound, Sessions
from furlong.server.state import StateDir
from furlong.types import AdamParams

OPTIMIZERS = ("adamw", "muon")  # optimizer_config.type values this server trains with

# An operation: validates the request (raising InputError or NotFound) and returns what runs,
# in seq order, on the run's TrainingModel.
Prepare = Callable[[], Callable[[TrainingModel], Any]]


@dataclass(frozen=True)
class TrainingConfig:
    """What training runs read of the service's settings (ServiceConfig, config.py)."""

    full_finetune: bool  # a model without lora_config trains its full weights (else refused)
    max_models_per_key: int  # training models one API key may hold loaded (0: no limit)
    gap_timeout: float  # seconds a run's log waits for a missing seq_id
    max_seq_ahead: int  # a seq_id further ahead of the next one is refused


@dataclass(frozen=True)
class DecodedFwdBwd:
    """A decoded ``forward_backward`` body: its model and ``seq_id``, and the request or why it
    was refused (a refusal still consumes the ``seq_id``)."""

    model_id: str
    seq_id: int
    request: proto.FwdBwdRequest | None
    error: InputError | None


@dataclass
class _TrainingRun:
    """One ``model_id``: its command log and, from operation 0 on until it is unloaded, its
    TrainingModel."""

    owner: str
    session_id: str
    log: CommandLog
    base_model: str
    lora: LoraSpec | None
    user_metadata: dict[str, Any] | None
    training_model: TrainingModel | None = None  # set by operation 0
    unloaded: bool = False


@dataclass
class TrainingRuns:
    config: TrainingConfig
    pool: ModelPool
    sessions: Sessions
    state: StateDir
    futures: FutureStore
    lane: ComputeLane
    _runs: dict[str, _TrainingRun] = field(default_factory=dict, init=False)  # by model_id

    def create_model(self, owner: str, req: tt.CreateModelRequest) -> str:
        self.sessions.check(owner, req.session_id)
        lora = self._lora(req.lora_config)
        self.pool.check_served(req.base_model)
        optimizer = optimizer_kind(req.optimizer_config)
        return self.create(
            owner,
            req.session_id,
            req.model_seq_id,
            req.base_model,
            lora,
            optimizer,
            req.user_metadata,
            then=lambda _model: {"type": "create_model"},
        )

    def create(
        self,
        owner: str,
        session_id: str,
        model_seq_id: int,
        base_model: str,
        lora: LoraSpec | None,
        optimizer: str,
        user_metadata: dict[str, Any] | None,
        then: Callable[[TrainingModel], dict[str, Any]],
    ) -> str:
        """Register a new ``model_id``; its operation 0 creates the TrainingModel and runs
        ``then`` on it (a checkpoint load, or nothing), whose dict completes the result. A
        model that ``then`` fails on is removed again."""
        if model_seq_id < 0:
            raise InputError(f"model_seq_id: must be >= 0, got {model_seq_id}")
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self._runs or self.state.read_run(model_id) is not None:
            raise InputError(f"model_seq_id: {model_seq_id} already used in this session")
        cap = self.config.max_models_per_key
        if cap and len(self.loaded(owner)) >= cap:
            raise InputError(
                f"base_model: this API key already has {cap} models loaded, the server's limit "
                "(--max-models-per-key); unload one (unload_model) or end its session first"
            )
        log = CommandLog(
            self.futures,
            self.lane.executor(owner),
            owner,
            first_seq=0,
            gap_timeout=self.config.gap_timeout,
            max_ahead=self.config.max_seq_ahead,
        )
        run = _TrainingRun(owner, session_id, log, base_model, lora, user_metadata)
        self._runs[model_id] = run
        self.sessions.add_model(session_id, model_id)

        def create() -> dict:
            model = self.pool.create(model_id, base_model, lora, optimizer=optimizer)
            try:
                result = then(model)
            except BaseException:
                self.pool.remove(model_id)
                raise
            run.training_model = model
            self.state.write_run(
                model_id,
                {
                    "base_model": base_model,
                    "owner": owner,
                    "is_lora": model.is_lora,
                    "lora_config": model.lora_config(),
                    "user_metadata": user_metadata,
                    "created": time.time(),
                },
            )
            return {"model_id": model_id} | result

        return log.submit(0, create)

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

    def _run(self, owner: str, model_id: str) -> _TrainingRun:
        run = self._runs.get(model_id)
        if run is None or run.owner != owner:
            raise NotFound(f"model {model_id!r}")
        if run.unloaded:
            raise NotFound(
                f"model {model_id!r} was unloaded (unload_model, or its session ended); its "
                "saved checkpoints remain: load one into a new model to go on"
            )
        self.sessions.touch(run.session_id)
        return run

    def session_id(self, model_id: str) -> str:
        """The session that created ``model_id`` (a known model)."""
        return self._runs[model_id].session_id

    def loaded(self, owner: str) -> list[str]:
        """The model ids of ``owner`` that hold memory (created or being created, not unloaded)."""
        return [m for m, r in self._runs.items() if r.owner == owner and not r.unloaded]

    def unload(self, owner: str, model_id: str) -> str:
        """``unload_model``: the model's queued operations fail, later ones are refused, and its
        memory is freed once the running one is done; the run's checkpoints stay. A future id
        (call on the event loop, like every command-log operation)."""
        return self._close(model_id, self._run(owner, model_id))

    def busy(self, model_ids: list[str]) -> bool:
        """Any of these models has an operation running or queued (its client is waiting)."""
        return any((run := self._runs.get(m)) is not None and run.log.busy for m in model_ids)

    def end_session(self, model_ids: list[str]) -> None:
        """The models of an ended session are unloaded (on the event loop)."""
        for model_id in model_ids:
            run = self._runs.get(model_id)
            if run is not None and not run.unloaded:
                self._close(model_id, run)

    def _close(self, model_id: str, run: _TrainingRun) -> str:
        run.unloaded = True

        def release() -> dict:
            model, run.training_model = run.training_model, None
            if model is not None:
                self.pool.remove(model_id)
            return {"model_id": model_id, "type": "unload_model"}

        return run.log.close(release, f"model_id: {model_id!r} was unloaded before this ran")

    def get_info(self, owner: str, model_id: str) -> dict:
        run = self._run(owner, model_id)
        lora = run.lora
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": "furlong",
                "model_name": run.base_model,
                "tokenizer_id": str(self.pool.tokenizer_dir(run.base_model).resolve()),
            },
            "is_lora": lora is not None,
            "lora_rank": None if lora is None else lora.rank,
            "model_name": run.base_model,
        }

    def submit(
        self, owner: str, model_id: str, seq_id: int | None, fingerprint: bytes, prepare: Prepare
    ) -> str:
        """Queue the operation ``prepare`` validates and returns; a refusal still consumes the
        model's ``seq_id`` (recorded as failed), so its next operation never waits for it."""
        run = self._run(owner, model_id)
        seq = _seq(seq_id)
        known = run.log.replay(seq, fingerprint)
        if known is not None:
            return known
        try:
            op = prepare()
        except (InputError, NotFound) as exc:
            run.log.refuse(seq, exc, fingerprint)
            raise

        def on_model() -> Any:
            model = run.training_model
            if model is None:  # creation failed (its future says why), or it was unloaded
                why = "was unloaded" if run.unloaded else "could not be created"
                raise InputError(f"model_id: the model {why}")
            return op(model)

        return run.log.submit(seq, on_model, fingerprint)

    def refuse(
        self, owner: str, fields: dict[str, Any], error: Exception, fingerprint: bytes
    ) -> None:
        """A seq-numbered request whose body failed validation: consume its ``seq_id`` when the
        body still names one of this owner's models and a usable ``seq_id``."""
        model_id, seq_id = fields.get("model_id"), fields.get("seq_id")
        run = self._runs.get(model_id) if isinstance(model_id, str) else None
        if run is None or run.owner != owner:
            return
        if _is_seq(seq_id):
            run.log.refuse(seq_id, error, fingerprint)

    def forward_backward(self, owner: str, decoded: DecodedFwdBwd, fingerprint: bytes) -> str:
        def prepare() -> Callable[[TrainingModel], bytes]:
            if decoded.error is not None:
                raise decoded.error
            req = decoded.request
            assert req is not None

            def run(model: TrainingModel) -> bytes:
                result = model.forward_backward(
                    req.data, req.loss_fn, req.loss_fn_config, req.forward_only
                )
                return proto.encode_forward_backward_output(result)

            return run

        return self.submit(owner, decoded.model_id, decoded.seq_id, fingerprint, prepare)

    def optim_step(self, owner: str, req: tt.OptimStepRequest, fingerprint: bytes = b"") -> str:
        def prepare() -> Callable[[TrainingModel], dict]:
            params = req.optim_params
            if not isinstance(params, tt.AdamParams):  # Muon models take AdamParams too
                raise InputError(
                    f"optimizer_params.type: {params.type!r} is not supported; send "
                    "adam_params (AdamW and Muon models both take them)"
                )
            adam = AdamParams(**params.model_dump(exclude={"type"}))

            def run(model: TrainingModel) -> dict:
                metrics = model.optim_step(adam)
                # JSON has no NaN: a vetoed step's norm is left out (skipped_nonfinite:sum says
                # why), so the SDK's response model still validates
                finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
                return {"metrics": finite, "type": "optim_step"}

            return run

        return self.submit(owner, req.model_id, req.seq_id, fingerprint, prepare)


def optimizer_kind(config: Any) -> str:
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


def _is_seq(seq_id: object) -> TypeGuard[int]:
    return isinstance(seq_id, int) and not isinstance(seq_id, bool) and seq_id >= 1


def _seq(seq_id: int | None) -> int:
    if not _is_seq(seq_id):
        raise InputError(f"seq_id: expected an integer >= 1, got {seq_id!r}")
    return seq_id
