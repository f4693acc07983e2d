"""The service behind ``furlong serve``, with Tinker's semantics and no HTTP in sight: its parts,
wired together, for ``app.py`` to map routes onto.

- ``sessions`` (sessions.py): client sessions;
- ``training`` (training.py): training runs (``model_id``), their ``seq_id``-ordered command
  logs, ``forward_backward`` and ``optim_step``;
- ``sampling`` (sampling.py): sampling sessions and ``sample`` on base models or snapshots;
- ``runs`` (runs.py): checkpoints (save, load, delete) and the run and checkpoint listings;
- ``pool`` (models.py): the served base models and every run's TrainingModel on them;
- ``jwt`` (jwt_auth.py): with ``jwt_auth``, the short-lived tokens keys are exchanged for.

Its settings (``ServiceConfig``, re-exported here) live in config.py, each part's beside it.

Hostile input is bounded before it is allocated: inflated body size, datums, tokens and dense
tensor elements per request (``proto.Limits``), and the sampling caps (sampling.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from furlong import host_memory
from furlong.errors import InputError
from furlong.precision import resolve_dtype
from furlong.server import proto
from furlong.server.compute_lane import ComputeLane
from furlong.server.config import ServiceConfig
from furlong.server.futures import FutureStore
from furlong.server.jwt_auth import JwtAuth
from furlong.server.models import ModelPool
from furlong.server.runs import Runs
from furlong.server.sampling import Sampling
from furlong.server.sessions import Sessions
from furlong.server.state import StateDir
from furlong.server.training import DecodedFwdBwd, TrainingRuns

__all__ = ["Service", "ServiceConfig", "fingerprint"]  # ServiceConfig: config.py, re-exported


class Service:
    def __init__(self, config: ServiceConfig):
        self.config = config
        # before the compute lane's thread starts: every step's activations reuse the last
        # step's heap pages instead of page-faulting fresh ones (furlong.host_memory)
        host_memory.keep_freed_blocks()
        state = StateDir(config.state_dir, clock=config.clock)
        self.pool = ModelPool(
            config.base_models,
            full_finetune=config.full_finetune,
            seed=config.seed,
            # absolute: clients load the tokenizer from this path, wherever they run
            tokenizer_root=Path(config.state_dir).resolve() / "tokenizers",
            trainer_ranks=config.trainer_ranks,
            dtype=getattr(torch, resolve_dtype(config.dtype)),
            engine_config=config.engine(),
        )
        self.futures = FutureStore(poll_timeout=config.poll_timeout)
        self.lane = ComputeLane()
        self.sessions = Sessions(config.session_timeout)
        parts = (self.pool, self.sessions, state, self.futures, self.lane)
        self.training = TrainingRuns(config.training(), *parts)
        self.sampling = Sampling(config.sampling(), *parts)
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


def fingerprint(body: bytes) -> bytes:
    """What a retry must repeat: the body's digest (a different body is a conflict)."""
    return hashlib.sha256(body).digest()
