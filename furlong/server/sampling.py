"""Sampling in the Tinker service: samplers (sampling sessions) and ``sample`` on a served base
model or on a sampler snapshot.

A sampler is a small record: its owner, session, base model and, for a snapshot, the files
``save_weights_for_sampler`` wrote. What sampling needs in memory is an engine: one per base
model (shared by every tenant), and one per snapshot, loaded on demand and released within
bounds by :class:`SnapshotCache` (a LoRA snapshot's engine shares its base's weights and costs
only its adapter). Each engine is fed fairly across tenants by a :class:`FairFeeder`.

Snapshots made by ``save_weights_for_sampler`` with a ``sampling_session_seq_id`` (what
``save_weights_and_get_sampling_client`` does every RL step) belong to their session: they are
not checkpoints, and they are deleted when the session ends.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinker import types as tt

from furlong.errors import InputError
from furlong.rollout.base import SamplingEngine
from furlong.rollout.registry import EngineRequest, build_engine
from furlong.server.compute_lane import ComputeLane
from furlong.server.futures import Failure, FutureStore
from furlong.server.models import ModelPool, sampling_model, snapshot_bytes
from furlong.server.sample_feeder import FairFeeder
from furlong.server.sample_request import SampleCaps, check_request, sample_result
from furlong.server.sessions import NotFound, Sessions
from furlong.server.snapshot_cache import SnapshotCache
from furlong.server.state import CheckpointRef, StateDir

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class SamplingConfig:
    """What sampling reads of the service's settings (ServiceConfig, config.py)."""

    caps: SampleCaps  # what one sample request may ask for
    sampler_slots: int  # sequences one engine decodes at once
    snapshot_engines: int  # snapshot engines kept loaded (LRU) ...
    sampler_memory_mb: int  # ... within this many MB of snapshot weights
    sampler_idle_s: float  # a snapshot engine unused this long is released (0: never)
    engine: str = "embedded"  # the engines' kind (furlong.rollout.registry)
    engine_options: Mapping[str, Any] = field(default_factory=dict)  # EngineRequest.options


@dataclass(frozen=True)
class _Sampler:
    owner: str
    session_id: str | None
    base_model: str
    model_path: str | None  # tinker://…/sampler_weights/… of a named snapshot
    snapshot: Path | None  # the snapshot's files; None: the base model


class Sampling:
    def __init__(
        self,
        config: SamplingConfig,
        pool: ModelPool,
        sessions: Sessions,
        state: StateDir,
        futures: FutureStore,
        lane: ComputeLane,
    ):
        self.config, self.pool, self.sessions = config, pool, sessions
        self.state, self.futures = state, futures
        self.caps = config.caps
        self.snapshots = SnapshotCache(
            self._build,
            lambda path: snapshot_bytes(self.pool, path),
            lane.submit,
            max_bytes=config.sampler_memory_mb << 20,
            max_engines=config.snapshot_engines,
            idle_s=config.sampler_idle_s,
        )
        self._lock = threading.Lock()  # _samplers and _base_feeders: HTTP and lane threads
        self._samplers: dict[str, _Sampler] = {}
        self._base_feeders: dict[str, FairFeeder] = {}
        # session-owned snapshots; sessions do not outlive the process, so neither do these
        self.session_root = state.root / "sessions"
        shutil.rmtree(self.session_root, ignore_errors=True)

    # ---------------------------------------------------------------- samplers

    def create_sampling_session(self, owner: str, req: tt.CreateSamplingSessionRequest) -> str:
        self.sessions.check(owner, req.session_id)
        if req.model_path:
            ref = CheckpointRef.parse(req.model_path, "model_path")
            if ref.segment != "sampler_weights":
                raise InputError(
                    "model_path: sample from a sampler_weights/ path "
                    "(save_weights_for_sampler), not a training-state path"
                )
            path = self.state.owned_checkpoint(owner, ref)
            base = (self.state.read_run(ref.run_id) or {}).get("base_model", "")
            return self.new_sampler(owner, req.session_id, base, path, ref.uri)
        if not req.base_model:
            raise InputError("base_model: required when no model_path is given")
        self.pool.check_served(req.base_model)
        return self.new_sampler(owner, req.session_id, req.base_model, None)

    def session_snapshot_dir(self, session_id: str, model_id: str, seq: int) -> Path:
        """Where ``save_weights_for_sampler`` puts a snapshot its session owns."""
        name = f"{model_id.replace(':', '_')}-{seq}"
        return self.session_root / session_id / name

    def new_sampler(
        self,
        owner: str,
        session_id: str | None,
        base_model: str,
        snapshot: Path | None,
        model_path: str | None = None,
    ) -> str:
        """Register a sampler (its engine is loaded when it first samples)."""
        sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        sampler = _Sampler(owner, session_id, base_model, model_path, snapshot)
        with self._lock:
            self._samplers[sampler_id] = sampler
        if session_id is not None:
            self.sessions.add_sampler(session_id, sampler_id)
        return sampler_id

    def forget_snapshot(self, path: Path) -> None:
        """Snapshot ``path`` is about to be overwritten or deleted: the live samplers on it keep
        the weights they were made with, in a hard-linked copy of its files (no bytes copied)
        that their session owns and deletes, and its loaded engine moves with them."""
        with self._lock:
            users = [(i, s) for i, s in self._samplers.items() if s.snapshot == path]
        if not users or not path.is_dir():
            self.snapshots.forget(path)
            return
        moved = False
        for session_id in {s.session_id for _, s in users}:
            copy = self.session_root / str(session_id) / f"kept-{uuid.uuid4().hex[:12]}"
            shutil.copytree(path, copy, copy_function=os.link)
            with self._lock:
                for sampler_id, s in users:
                    if s.session_id == session_id:
                        self._samplers[sampler_id] = replace(s, snapshot=copy)
            if not moved:  # the first session takes the loaded engine; others rebuild theirs
                self.snapshots.move(path, copy)
                moved = True

    def end_session(self, session_id: str, sampler_ids: list[str]) -> None:
        """An ended session's samplers go, with the engines only they used and the snapshots
        the session owned."""
        with self._lock:
            for sampler_id in sampler_ids:
                self._samplers.pop(sampler_id, None)
        self.snapshots.drop_users(sampler_ids)
        # not checkpoints: nothing to keep if a crash interrupts this (start-up wipes the rest)
        shutil.rmtree(self.session_root / session_id, ignore_errors=True)

    def sampler_info(self, owner: str, sampler_id: str) -> dict:
        s = self._sampler(owner, sampler_id)
        return {"sampler_id": sampler_id, "base_model": s.base_model, "model_path": s.model_path}

    def _sampler(self, owner: str, sampler_id: str) -> _Sampler:
        with self._lock:
            s = self._samplers.get(sampler_id)
        if s is None or s.owner != owner:
            raise NotFound(f"sampler {sampler_id!r} (unknown, or its session ended)")
        if s.session_id is not None:
            self.sessions.touch(s.session_id)
        return s

    # ---------------------------------------------------------------- engines

    def _base_feeder(self, base_model: str) -> FairFeeder:
        with self._lock:
            feeder = self._base_feeders.get(base_model)
        if feeder is None:  # two racing threads build two; one is kept (the base is shared)
            feeder = self._feeder(*self.pool.base(base_model))
            with self._lock:
                feeder = self._base_feeders.setdefault(base_model, feeder)
        return feeder

    def _build(self, path: Path) -> FairFeeder:
        """A snapshot's engine (runs on the compute lane)."""
        return self._feeder(*sampling_model(self.pool, path))

    def _feeder(self, model: PreTrainedModel, tokenizer: Any) -> FairFeeder:
        slots, options = self.config.sampler_slots, self.config.engine_options
        request = EngineRequest(model, tokenizer, max_running=slots, options=options)
        return FairFeeder(build_engine(self.config.engine, request, SamplingEngine))

    def _engine(self, owner: str, sampler_id: str | None, s: _Sampler) -> Future[FairFeeder]:
        if s.snapshot is None:
            done: Future[FairFeeder] = Future()
            done.set_result(self._base_feeder(s.base_model))
            return done
        return self.snapshots.engine(owner, s.snapshot, sampler_id)

    # ---------------------------------------------------------------- sample

    def sample(self, owner: str, req: tt.SampleRequest) -> tuple[str, list[str]]:
        """Queue ``num_samples`` sequences; returns the request id and the sequence ids. Never
        waits: a snapshot engine that is not loaded is built on the compute lane first."""
        sampler_id = req.sampling_session_id
        s = self._sampler(owner, sampler_id) if sampler_id else self._legacy(owner, req)
        shape = self._base_feeder(s.base_model).engine  # a snapshot keeps its base's shape
        checked = check_request(req, shape, self.caps)
        prompts = [checked.prompt] * req.num_samples
        shape.check_requests(prompts, checked.params)  # the whole request, before queueing
        request_id = self.futures.create(owner)

        def start(engine: Future[FairFeeder]) -> None:
            try:
                futures = engine.result().submit(owner, prompts, checked.params)
            except Exception as exc:  # noqa: BLE001 - reported through the future
                failure = (
                    Failure(str(exc), "user")
                    if isinstance(exc, InputError)
                    else Failure(f"{type(exc).__name__}: {exc}", "server")
                )
                self.futures.resolve(request_id, failure)
                return

            def done(_f: Any) -> None:
                if all(f.done() for f in futures):
                    self.futures.resolve(request_id, sample_result(futures, checked.scored_from))

            for f in futures:
                f.add_done_callback(done)

        self._engine(owner, sampler_id, s).add_done_callback(start)
        return request_id, [f"{request_id}-{i}" for i in range(req.num_samples)]

    def _legacy(self, owner: str, req: tt.SampleRequest) -> _Sampler:
        """A request that names its model instead of a sampling session."""
        if not req.model_path:
            self.pool.check_served(req.base_model or "")
            return _Sampler(owner, None, req.base_model or "", None, None)
        ref = CheckpointRef.parse(req.model_path, "model_path")
        if ref.segment != "sampler_weights":
            raise InputError("model_path: sample from a sampler_weights/ path")
        path = self.state.owned_checkpoint(owner, ref)
        base = (self.state.read_run(ref.run_id) or {}).get("base_model", "")
        return _Sampler(owner, None, base, ref.uri, path)
