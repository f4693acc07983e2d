"""Checkpoints and run records of the Tinker service: ``save_weights`` (training state),
``save_weights_for_sampler`` (a sampler snapshot), ``load_weights`` (into a model, or as a new
model's first operation), and the REST listings of runs and checkpoints, each scoped to its
owner. The layout on disk is ``state.py``'s.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker import types as tt

from furlong.errors import InputError
from furlong.models.loading import remove_dir
from furlong.server.models import LoraSpec, ModelPool, TrainingModel
from furlong.server.sampling import Sampling
from furlong.server.sessions import NotFound, Sessions
from furlong.server.state import CheckpointRef, StateDir, check_name, iso_time
from furlong.server.training import TrainingRuns, optimizer_kind
from furlong.train.dist_checkpoint import saved_optimizer_kind


@dataclass
class Runs:
    state: StateDir
    pool: ModelPool
    sessions: Sessions
    training: TrainingRuns
    sampling: Sampling

    # ---------------------------------------------------------------- checkpoint operations

    def save_weights(self, owner: str, req: tt.SaveWeightsRequest, fingerprint: bytes = b"") -> str:
        def prepare() -> Callable[[TrainingModel], dict]:
            name = check_name(_name_or_stamp(req.path), "path")
            ref = CheckpointRef(req.model_id, "weights", name)

            def run(model: TrainingModel) -> dict:
                model.save_state(self.state.checkpoint_dir(ref))
                return {"path": ref.uri, "type": "save_weights"}

            return run

        return self.training.submit(owner, req.model_id, req.seq_id, fingerprint, prepare)

    def save_weights_for_sampler(
        self, owner: str, req: tt.SaveWeightsForSamplerRequest, fingerprint: bytes = b""
    ) -> str:
        session = req.sampling_session_seq_id

        def prepare() -> Callable[[TrainingModel], dict]:
            if req.path is None and session is None:
                raise InputError("path: give a name or a sampling_session_seq_id")
            name = check_name(_name_or_stamp(req.path, "sampler-"), "path")
            ref = CheckpointRef(req.model_id, "sampler_weights", name)

            def run(model: TrainingModel) -> dict:
                path = self.state.checkpoint_dir(ref)
                model.save_sampler_weights(path)
                self.sampling.forget_snapshot(path)
                if session is None:
                    return {"path": ref.uri, "type": "save_weights_for_sampler"}
                sampler_id = self.sampling.new_sampler(owner, model.base_model, ref.uri)
                return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

            return run

        return self.training.submit(owner, req.model_id, req.seq_id, fingerprint, prepare)

    def load_weights(self, owner: str, req: tt.LoadWeightsRequest, fingerprint: bytes = b"") -> str:
        if req.session_id is None:  # mode A: into an existing model, in seq order

            def prepare() -> Callable[[TrainingModel], dict]:
                return _load(*self._loadable(owner, req.path), optimizer=req.optimizer)

            return self.training.submit(owner, req.model_id or "", req.seq_id, fingerprint, prepare)
        ref, source = self._loadable(owner, req.path)
        # mode B: create-via-load; the load is the new model's operation 0
        self.sessions.check(owner, req.session_id)
        meta = self.state.read_run(ref.run_id) or {}
        base = req.base_model or meta["base_model"]
        self.pool.check_served(base)
        lora_cfg = meta.get("lora_config") or {}
        # with its optimizer state a model keeps the checkpoint's optimizer
        optimizer = (
            saved_optimizer_kind(source)  # a single-process or a multi-rank (DCP) checkpoint
            if req.optimizer
            else optimizer_kind(req.optimizer_config)
        )
        return self.training.create(
            owner,
            req.session_id,
            req.model_seq_id,
            base,
            LoraSpec(**lora_cfg) if lora_cfg else None,
            optimizer,
            req.user_metadata,
            then=_load(ref, source, optimizer=req.optimizer),
        )

    def _loadable(self, owner: str, path: str) -> tuple[CheckpointRef, Path]:
        ref = CheckpointRef.parse(path)
        if ref.segment != "weights":
            raise InputError(f"path: {path!r} is a sampler snapshot; load a weights/ path")
        return ref, self.state.owned_checkpoint(owner, ref)

    # ---------------------------------------------------------------- listings

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
        path = self.state.owned_checkpoint(owner, ref)
        self.sampling.forget_snapshot(path)
        remove_dir(path)

    def weights_info(self, owner: str, tinker_path: str) -> dict:
        ref = CheckpointRef.parse(tinker_path, "tinker_path")
        self.state.owned_checkpoint(owner, ref)
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


def _load(ref: CheckpointRef, source: Path, optimizer: bool) -> Callable[[TrainingModel], dict]:
    def load(model: TrainingModel) -> dict:
        model.load_state(source, optimizer=optimizer)
        return {"path": ref.uri, "type": "load_weights"}

    return load


def _name_or_stamp(name: str | None, prefix: str = "") -> str:
    """The client's name (an empty one is refused by ``check_name``) or a fresh stamp."""
    if name is not None:
        return name
    return f"{prefix}{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def _str_dict(d: Any) -> dict[str, str] | None:
    return None if not d else {str(k): str(v) for k, v in d.items()}
