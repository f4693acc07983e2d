"""Checkpoints and run records of the Tinker service: ``save_weights`` (training state),
``save_weights_for_sampler`` (a sampler snapshot), ``save_weights_external`` (an HF export with
download URLs, external_weights.py), ``load_weights`` (into a model, or as a new model's first
operation), checkpoint TTLs (checkpoint_ttl.py), ``copy_weights``, and the REST listings of runs
and checkpoints, each scoped to its owner. The layout on disk is ``state.py``'s.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker import types as tt

from furlong.errors import InputError
from furlong.models.loading import atomic_dir, publish_dir
from furlong.server import age_encryption, checkpoint_archive, external_weights
from furlong.server.checkpoint_ttl import CheckpointTtl, check_ttl
from furlong.server.external_weights import DownloadSigner
from furlong.server.models import LoraSpec, ModelPool, TrainingModel
from furlong.server.sampling import Sampling
from furlong.server.sessions import NotFound, Sessions
from furlong.server.state import SEGMENTS, CheckpointRef, StateDir, check_name, iso_time
from furlong.server.training import TrainingRuns, optimizer_kind
from furlong.train.dist_checkpoint import saved_optimizer_kind


@dataclass
class Runs:
    state: StateDir
    pool: ModelPool
    sessions: Sessions
    training: TrainingRuns
    sampling: Sampling
    ttl: CheckpointTtl = field(init=False)
    signer: DownloadSigner = field(init=False)
    _copy_lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        self.ttl = CheckpointTtl(self.state, self.sampling.forget_snapshot)
        self.signer = DownloadSigner(self.state.clock)

    # ---------------------------------------------------------------- checkpoint operations

    def save_weights(self, owner: str, req: tt.SaveWeightsRequest, fingerprint: bytes = b"") -> str:
        def prepare() -> Callable[[TrainingModel], dict]:
            name = check_name(_name_or_stamp(req.path), "path")
            ttl = check_ttl(req.ttl_seconds)
            ref = CheckpointRef(req.model_id, "weights", name)

            def run(model: TrainingModel) -> dict:
                with self.ttl.saving(ref, ttl):
                    model.save_state(self.state.checkpoint_dir(ref))
                return {"path": ref.uri, "type": "save_weights"}

            return run

        return self.training.submit(owner, req.model_id, req.seq_id, fingerprint, prepare)

    def save_weights_for_sampler(
        self, owner: str, req: tt.SaveWeightsForSamplerRequest, fingerprint: bytes = b""
    ) -> str:
        session = req.sampling_session_seq_id

        def prepare() -> Callable[[TrainingModel], dict]:
            if req.kind == "inflight":  # a snapshot would never follow later saves
                raise InputError(
                    "kind: 'inflight' samplers are not supported by furlong; use kind='snapshot' "
                    "(the default) and save again for newer weights"
                )
            if req.path is None and session is None:
                raise InputError("path: give a name or a sampling_session_seq_id")
            ttl = check_ttl(req.ttl_seconds)
            session_id = self.training.session_id(req.model_id)
            if req.path is None:  # the session's own snapshot: no checkpoint, gone with it
                assert req.seq_id is not None  # submit checked it before calling prepare
                path = self.sampling.session_snapshot_dir(session_id, req.model_id, req.seq_id)

                def own(model: TrainingModel) -> dict:
                    model.save_sampler_weights(path)
                    sampler_id = self.sampling.new_sampler(
                        owner, session_id, model.base_model, path
                    )
                    return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

                return own
            ref = CheckpointRef(req.model_id, "sampler_weights", check_name(req.path, "path"))

            def run(model: TrainingModel) -> dict:
                path = self.state.checkpoint_dir(ref)
                self.sampling.forget_snapshot(path)  # live samplers keep what they sample
                with self.ttl.saving(ref, ttl):
                    model.save_sampler_weights(path)
                if session is None:
                    return {"path": ref.uri, "type": "save_weights_for_sampler"}
                sampler_id = self.sampling.new_sampler(
                    owner, session_id, model.base_model, path, ref.uri
                )
                return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

            return run

        return self.training.submit(owner, req.model_id, req.seq_id, fingerprint, prepare)

    def save_weights_external(
        self, owner: str, req: tt.SaveWeightsExternalRequest, fingerprint: bytes = b""
    ) -> str:
        """An HF export of the model's weights, in seq order like every save; with
        ``age_encryption_recipients`` each file is stored encrypted as ``<file>.age``."""

        def prepare() -> Callable[[TrainingModel], dict]:
            name = check_name(req.path, "path")
            ttl = check_ttl(req.ttl_seconds)
            recipients = age_encryption.parse_recipients(req.age_encryption_recipients)
            ref = CheckpointRef(req.model_id, "external_weights", name)

            def run(model: TrainingModel) -> dict:
                path = self.state.checkpoint_dir(ref)
                with self.ttl.saving(ref, ttl):
                    size = external_weights.export(model, path, recipients)
                return {"path": ref.uri, "size_bytes": size, "type": "save_weights_external"}

            return run

        return self.training.submit(owner, req.model_id, req.seq_id, fingerprint, prepare)

    def load_weights(self, owner: str, req: tt.LoadWeightsRequest, fingerprint: bytes = b"") -> str:
        if req.session_id is None:  # mode A: into an existing model, in seq order

            def prepare() -> Callable[[TrainingModel], dict]:
                return _load(*self._loadable(owner, req.path), optimizer=req.optimizer)

            return self.training.submit(owner, req.model_id or "", req.seq_id, fingerprint, prepare)
        # mode B: create-via-load; the load is the new model's operation 0
        if req.model_seq_id is None:
            raise InputError("model_seq_id: required with session_id (create-via-load)")
        ref, source = self._loadable(owner, req.path)
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
        if ref.segment == "sampler_weights":
            raise InputError(f"path: {path!r} is a sampler snapshot; load a weights/ path")
        if ref.segment != "weights":
            raise InputError(f"path: {path!r} is an HF export; load a weights/ path")
        return ref, self.state.owned_checkpoint(owner, ref)

    # ---------------------------------------------------------------- external weights, TTL, copies

    def external_weights_urls(
        self, owner: str, run_id: str, segment: str, name: str
    ) -> tuple[dict[str, str], int]:
        """``{file: download token}`` for every file of an external-weights checkpoint, and when
        the tokens expire (Unix seconds)."""
        ref = _ref(run_id, segment, name)
        if ref.segment != "external_weights":
            raise InputError(
                f"checkpoint_id: {segment}/{name} is not an external_weights/ checkpoint "
                "(save_weights_external makes one)"
            )
        path = self.state.owned_checkpoint(owner, ref)
        expires = self.signer.expiry()
        sign = self.signer.token
        return {f: sign(owner, ref, f, expires) for f in external_weights.files(path)}, expires

    def download_owner(self, token: str, run_id: str, segment: str, name: str, file: str) -> str:
        """The tenant a download URL's token was signed for (``InvalidDownloadToken`` if it
        is not genuine, for another file, or expired)."""
        return self.signer.verify(token, _ref(run_id, segment, name), file)

    def external_file(self, owner: str, run_id: str, segment: str, name: str, file: str) -> Path:
        """One file of ``owner``'s external-weights checkpoint (404 for anything else)."""
        ref = _ref(run_id, segment, name)
        path = self.state.owned_checkpoint(owner, ref)
        if ref.segment != "external_weights" or file not in external_weights.files(path):
            raise NotFound(f"file {file!r} of {ref.uri!r}")
        return path / file

    def archive_url(self, owner: str, run_id: str, segment: str, name: str) -> tuple[str, int]:
        """A download token for the tar of ``owner``'s sampler snapshot, and when it expires
        (Unix seconds): the archive route of SDKs up to 0.37."""
        ref = _ref(run_id, segment, name)
        if ref.segment == "weights":
            raise InputError(
                f"checkpoint_id: {segment}/{name} is a training checkpoint, which has no archive; "
                "export it with save_weights_external (tinker_cookbook.weights.download does)"
            )
        if ref.segment != "sampler_weights":
            raise InputError(
                f"checkpoint_id: {segment}/{name} is an HF export; download its files from "
                "external_weights_urls"
            )
        self.state.owned_checkpoint(owner, ref)
        expires = self.signer.expiry()
        return self.signer.token(owner, ref, checkpoint_archive.ARCHIVE_FILE, expires), expires

    def archive(
        self, owner: str, run_id: str, segment: str, name: str
    ) -> checkpoint_archive.Archive:
        """The tar of ``owner``'s sampler snapshot, its files open (404 for anything else)."""
        ref = _ref(run_id, segment, name)
        path = self.state.owned_checkpoint(owner, ref)
        if ref.segment != "sampler_weights":
            raise NotFound(f"archive of {ref.uri!r}")
        try:
            return checkpoint_archive.open_archive(path)
        except FileNotFoundError:  # deleted or expired while its files were opened
            raise NotFound(f"checkpoint {ref.uri!r}") from None

    def set_ttl(self, owner: str, run_id: str, segment: str, name: str, ttl: Any) -> None:
        ref = _ref(run_id, segment, name)
        ttl_seconds = check_ttl(ttl)
        self.state.owned_checkpoint(owner, ref)
        self.ttl.set(ref, ttl_seconds)

    def copy_weights(self, owner: str, req: tt.CopyWeightsRequest, idempotency_key: str) -> str:
        """Copy ``owner``'s checkpoint into a new training run (files hard-linked: no bytes are
        duplicated, and deleting either copy leaves the other whole). The run cannot be trained;
        its checkpoint loads and samples like the source. A retry with the same
        ``X-Idempotency-Key`` answers the first copy's path."""
        source_ref = CheckpointRef.parse(req.source_path, "source_path")
        ttl = check_ttl(req.ttl_seconds)
        source = self.state.owned_checkpoint(owner, source_ref)
        key = hashlib.sha256(f"{owner}\n{idempotency_key or uuid.uuid4()}".encode()).hexdigest()
        run_id = self._copy_destination(owner, req, key)
        ref = CheckpointRef(run_id, source_ref.segment, source_ref.name)
        with self._copy_lock:
            meta = self.state.read_run(run_id)
            if meta is not None and meta.get("copy_key") != key:
                raise InputError(f"model_seq_id: training run {run_id!r} already exists")
            if meta is None or not self.state.checkpoint_dir(ref).is_dir():
                source_meta = self.state.read_run(source_ref.run_id) or {}
                self.state.write_run(run_id, _copy_meta(source_meta, req, source_ref, key))
                with self.ttl.saving(ref, ttl):
                    _link_tree(source, self.state.checkpoint_dir(ref))
        return ref.uri

    def _copy_destination(self, owner: str, req: tt.CopyWeightsRequest, key: str) -> str:
        """``<session_id>:train:<model_seq_id>`` (that slot must be free), or with a project a
        run named after the idempotency key, so a retried copy finds its first attempt."""
        if req.session_id is None and req.model_seq_id is None:
            if not req.destination_project_id:
                raise InputError(
                    "destination_project_id: required (or session_id and model_seq_id)"
                )
            return f"copy:{key[:20]}"
        if req.session_id is None or req.model_seq_id is None or req.model_seq_id < 0:
            raise InputError("model_seq_id: give session_id and a model_seq_id >= 0 together")
        self.sessions.check(owner, req.session_id)
        run_id = f"{req.session_id}:train:{req.model_seq_id}"
        try:
            self.training.get_info(owner, run_id)
        except NotFound:
            return run_id
        raise InputError(f"model_seq_id: training run {run_id!r} already exists")

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
        self.ttl.sweep(run_id)  # what a client sees expired is deleted before it looks again
        return self.state.checkpoints(run_id)

    def delete_checkpoint(self, owner: str, run_id: str, segment: str, name: str) -> None:
        ref = _ref(run_id, segment, name)
        self.state.owned_checkpoint(owner, ref)
        self.ttl.delete(ref)

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


def _ref(run_id: str, segment: str, name: str) -> CheckpointRef:
    """The checkpoint of a REST path ``training_runs/{run_id}/checkpoints/{segment}/{name}``."""
    if segment not in SEGMENTS:
        raise InputError(f"segment: {segment!r} is not one of {sorted(SEGMENTS)}")
    return CheckpointRef.parse(f"tinker://{run_id}/{segment}/{name}", "checkpoint_id")


def _copy_meta(
    source: dict[str, Any], req: tt.CopyWeightsRequest, source_ref: CheckpointRef, key: str
) -> dict[str, Any]:
    """The copy's run record: the source run's model (so it loads and samples the same), marked
    as a copy that no training model backs."""
    keep = ("base_model", "owner", "is_lora", "lora_config", "user_metadata")
    return {k: source.get(k) for k in keep} | {
        "created": time.time(),
        "copied_from": source_ref.uri,
        "project_id": req.destination_project_id,
        "trainable": False,
        "copy_key": key,
    }


def _link_tree(source: Path, path: Path) -> None:
    """Publish a copy of ``source`` at ``path`` atomically, hard-linking each file (checkpoint
    files are never changed in place: a re-save publishes a new directory), or copying it
    across file systems."""
    tmp, final = atomic_dir(path)
    try:
        for src in sorted(source.rglob("*")):
            dst = tmp / src.relative_to(source)
            if src.is_dir():
                dst.mkdir()
                continue
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, final)


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
