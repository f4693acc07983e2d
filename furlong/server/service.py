"""The service behind ``furlong serve``, with Tinker's semantics and no HTTP in sight: its parts,
wired together, for ``app.py`` to map routes onto.

- ``sessions`` (sessions.py): client sessions;
- ``training`` (training.py): training runs (``model_id``), their ``seq_id``-ordered command
  logs, ``forward_backward`` and ``optim_step``;
- ``sampling`` (sampling.py): sampling sessions and ``sample`` on base models or snapshots;
- ``runs`` (runs.py): checkpoints (save, load, delete) and the run and checkpoint listings;
- ``pool`` (models.py): the served base models and every run's TrainingModel on them;
- ``jwt`` (jwt_auth.py): with ``jwt_auth``, the short-lived tokens keys are exchanged for.

Hostile input is bounded before it is allocated: inflated body size, datums, tokens and dense
tensor elements per request (``proto.Limits``), and the sampling caps (sampling.py).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from furlong.errors import InputError
from furlong.server import proto
from furlong.server.compute_lane import ComputeLane
from furlong.server.futures import FutureStore
from furlong.server.jwt_auth import JwtAuth
from furlong.server.models import ModelPool
from furlong.server.runs import Runs
from furlong.server.sampling import Sampling
from furlong.server.sessions import Sessions
from furlong.server.state import StateDir
from furlong.server.training import DecodedFwdBwd, TrainingRuns
from furlong.train.engine import EngineConfig
from furlong.train.optim import OptimizerConfig


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
    snapshot_engines: int = 8  # sampler snapshot engines kept loaded (LRU) ...
    sampler_memory_mb: int = 4096  # ... within this many MB of snapshot weights (LoRA: adapters)
    sampler_idle_s: float = 600.0  # a snapshot engine unused this long is released (0: never)
    session_timeout: float = 120.0  # a session silent this long ends (0: never; SDK beats: 10 s)
    max_models_per_key: int = 16  # training models one API key may hold loaded (0: no limit)
    compress_fwdbwd: bool = False  # ask clients to zstd forward_backward bodies
    fwdbwd_max_chunk_len: int = 1024  # datums per forward_backward request (client-side split)
    trainer_ranks: int = 1  # > 1: full fine-tunes train on that many FSDP2 ranks (LoRA: 1)
    optimizer_state_dir: str | None = None  # every model's optimizer state on disk there
    jwt_auth: bool = False  # clients exchange their key for a short-lived JWT (auth/token)
    ttl_sweep_interval: float = 60.0  # seconds between sweeps deleting expired checkpoints
    clock: Callable[[], float] = time.time  # wall time for checkpoint TTLs, URLs and JWTs

    def __post_init__(self) -> None:
        for name, least in (
            ("max_models_per_key", 0),
            ("session_timeout", 0),
            ("snapshot_engines", 1),
            ("sampler_memory_mb", 1),
            ("sampler_idle_s", 0),
        ):
            if not getattr(self, name) >= least:
                raise InputError(f"{name}: must be >= {least}, got {getattr(self, name)!r}")


class Service:
    def __init__(self, config: ServiceConfig):
        self.config = config
        state = StateDir(config.state_dir, clock=config.clock)
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
        self.sessions = Sessions(config.session_timeout)
        self.training = TrainingRuns(
            config, self.pool, self.sessions, state, self.futures, self.lane
        )
        self.sampling = Sampling(config, self.pool, self.sessions, state, self.futures, self.lane)
        self.runs = Runs(state, self.pool, self.sessions, self.training, self.sampling)
        self.runs.ttl.sweep()  # checkpoints that expired while the server was down
        self.ttl_sweeper = self.runs.ttl.start(config.ttl_sweep_interval)
        self.jwt = JwtAuth(config.clock) if config.jwt_auth else None

    def end_session(self, session_id: str) -> bool:
        """Unload the session's models and release its samplers (on the event loop; the models'
        memory is freed on the compute lane once their running operations are done). The
        saved checkpoints stay. False if it had already ended."""
        session = self.sessions.end(session_id)
        if session is None:
            return False
        self.training.end_session(session.model_ids)
        self.sampling.end_session(session_id, session.sampler_ids)
        return True

    def reap(self) -> int:
        """End the sessions silent past ``session_timeout`` and release snapshot engines idle
        past ``sampler_idle_s`` (on the event loop, every ``reap_interval`` s). Sessions ended."""
        silent = self.sessions.silent()
        # a client polling a long operation may send nothing else: its session lives on
        ended = sum(
            self.end_session(sid)
            for sid in silent
            if not self.training.busy(self.sessions.models(sid))
        )
        self.sampling.snapshots.release_idle()
        return ended

    @property
    def reap_interval(self) -> float:
        bounds = [t / 4 for t in (self.config.session_timeout, self.config.sampler_idle_s) if t > 0]
        return min([30.0, *bounds])

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


def fingerprint(body: bytes) -> bytes:
    """What a retry must repeat: the body's digest (a different body is a conflict)."""
    return hashlib.sha256(body).digest()
