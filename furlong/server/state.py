"""What the service keeps on disk under ``--state-dir``: training runs and their checkpoints.

Layout (``<run>`` is the model id ``<session_id>:train:<n>``)::

    runs/<run>/run.json                     base model, LoRA config, owner, user metadata
    runs/<run>/weights/<name>/              training state: weights + optimizer (atomic dir)
    runs/<run>/sampler_weights/<name>/      sampler snapshot (atomic dir)
    runs/<run>/external_weights/<name>/     HF export: peft adapter or HF model (atomic dir)
    runs/<run>/<segment>/.<name>.expires    the checkpoint's expiry time, if it has a TTL
    tokenizers/<base>/                      the served bases' tokenizers (atomic dir)

``tinker://<run>/<weights|sampler_weights|external_weights>/<name>`` names a checkpoint. Names
are checked so a path can never leave the state directory. A checkpoint past its expiry is
neither listed nor found (``checkpoint_ttl.py`` deletes it), whatever the sweeper has done yet.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from furlong.atomic import atomic_write_text
from furlong.errors import InputError
from furlong.models.loading import recover_published
from furlong.server.sessions import NotFound

log = logging.getLogger("furlong.serve")
SEGMENTS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
EXPIRY_SUFFIX = ".expires"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")


def check_name(name: str, field: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise InputError(
            f"{field}: {name!r} is not a valid name (letters, digits, '.', '_', ':', '-'; "
            "no '/' or '..'; at most 200 characters)"
        )
    return name


@dataclass(frozen=True)
class CheckpointRef:
    run_id: str
    segment: str  # weights | sampler_weights
    name: str

    @classmethod
    def parse(cls, path: str, field: str = "path") -> CheckpointRef:
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise InputError(f"{field}: {path!r} is not a tinker:// path")
        parts = path[len("tinker://") :].split("/")
        if len(parts) != 3 or parts[1] not in SEGMENTS:
            raise InputError(
                f"{field}: {path!r} is not "
                "tinker://<run>/<weights|sampler_weights|external_weights>/<name>"
            )
        return cls(check_name(parts[0], field), parts[1], check_name(parts[2], field))

    @property
    def uri(self) -> str:
        return f"tinker://{self.run_id}/{self.segment}/{self.name}"


def owner_id(api_key: str) -> str:
    """A stable tenant id for a key; the key itself is never written to disk."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


class StateDir:
    def __init__(self, root: str | os.PathLike, clock: Callable[[], float] = time.time):
        self.root = Path(root)
        self.clock = clock  # wall time in seconds; injectable so tests can move it
        (self.root / "runs").mkdir(parents=True, exist_ok=True)
        # Before any request: a checkpoint whose overwrite a crash cut short is back, and the
        # temp dirs of interrupted writes are gone. Assumes one service per state dir.
        self.recovered = recover_published(self.root)

    def run_dir(self, run_id: str) -> Path:
        return self.root / "runs" / check_name(run_id, "model_id")

    def checkpoint_dir(self, ref: CheckpointRef) -> Path:
        return self.run_dir(ref.run_id) / ref.segment / ref.name

    def owned_checkpoint(self, owner: str, ref: CheckpointRef) -> Path:
        """``ref``'s directory, if it exists and its run is ``owner``'s."""
        meta = self.read_run(ref.run_id)
        path = self.checkpoint_dir(ref)
        if meta is None or meta.get("owner") != owner or not path.is_dir() or self.expired(ref):
            raise NotFound(f"checkpoint {ref.uri!r}")
        return path

    def expiry_file(self, ref: CheckpointRef) -> Path:
        """Beside the checkpoint; a leading dot, which no checkpoint name has, so the two never
        collide and listings skip it."""
        return self.run_dir(ref.run_id) / ref.segment / f".{ref.name}{EXPIRY_SUFFIX}"

    def expires_at(self, ref: CheckpointRef) -> float | None:
        """When ``ref`` expires (Unix seconds), or None if it never does."""
        try:
            return float(json.loads(self.expiry_file(ref).read_text())["expires_at"])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError):  # written atomically: only a disk fault
            log.warning("unreadable expiry of %s; keeping the checkpoint", ref.uri)
            return None

    def write_expiry(self, ref: CheckpointRef, expires_at: float | None) -> None:
        """Atomically set (temp file + rename) or clear ``ref``'s expiry."""
        path = self.expiry_file(ref)
        if expires_at is None:
            path.unlink(missing_ok=True)
            return
        _write_json(path, {"expires_at": expires_at, "checkpoint": ref.uri})

    def expired(self, ref: CheckpointRef) -> bool:
        expires_at = self.expires_at(ref)
        return expires_at is not None and self.clock() >= expires_at

    def write_run(self, run_id: str, meta: dict[str, Any]) -> None:
        """Atomically (temp file + rename) record a run's metadata."""
        _write_json(self.run_dir(run_id) / "run.json", meta)

    def read_run(self, run_id: str) -> dict[str, Any] | None:
        path = self.run_dir(run_id) / "run.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def runs(self) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for d in sorted((self.root / "runs").iterdir()):
            meta = self.read_run(d.name) if _NAME.fullmatch(d.name) else None
            if meta is not None:
                out.append((d.name, meta))
        return out

    def checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        """Checkpoint records (Tinker's ``Checkpoint`` fields), oldest first."""
        out = []
        for segment, kind in SEGMENTS.items():
            base = self.run_dir(run_id) / segment
            for d in sorted(base.iterdir()) if base.is_dir() else []:
                if not d.is_dir() or not _NAME.fullmatch(d.name):
                    continue  # temp dirs of writes in progress
                ref = CheckpointRef(run_id, segment, d.name)
                expires_at = self.expires_at(ref)
                if expires_at is not None and self.clock() >= expires_at:
                    continue  # expired: gone for clients even before the sweeper deletes it
                try:
                    mtime, size = d.stat().st_mtime, dir_size(d)
                except FileNotFoundError:
                    continue  # deleted (or swept) while we looked
                out.append(
                    {
                        "checkpoint_id": f"{segment}/{d.name}",
                        "checkpoint_type": kind,
                        "time": iso_time(mtime),
                        "tinker_path": ref.uri,
                        "size_bytes": size,
                        "public": False,
                        "expires_at": None if expires_at is None else iso_time(expires_at),
                    }
                )
        return sorted(out, key=lambda c: c["time"])


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    """Temp file, fsync, rename: a reader sees the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(obj, indent=1))


def iso_time(timestamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))
