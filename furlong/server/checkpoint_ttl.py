"""Checkpoint expiry (``ttl_seconds``): validation, setting it with a save, and deleting what
has expired.

The expiry time lives on disk beside the checkpoint (``StateDir.expiry_file``, written temp +
rename), so it survives a restart. ``StateDir`` already hides an expired checkpoint from every
listing and load; :class:`CheckpointTtl` deletes it: at start-up, from a background thread
every ``interval`` seconds, and when its run is listed. One lock orders every expiry change,
deletion and sweep, so a sweep never deletes a checkpoint that a save is re-publishing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from furlong.errors import InputError
from furlong.models.loading import remove_dir
from furlong.server.state import EXPIRY_SUFFIX, SEGMENTS, CheckpointRef, StateDir, check_name

log = logging.getLogger("furlong.serve")

MIN_TTL = 3600  # the SDK's documented bounds: 1 hour ...
MAX_TTL = 10 * 365 * 86400  # ... to 10 years


def check_ttl(ttl_seconds: object, field_name: str = "ttl_seconds") -> int | None:
    """``ttl_seconds`` as the SDK documents it: None (never expires) or 1 hour to 10 years."""
    if ttl_seconds is None:
        return None
    if not isinstance(ttl_seconds, int) or isinstance(ttl_seconds, bool):
        raise InputError(f"{field_name}: expected an integer number of seconds or null")
    if not MIN_TTL <= ttl_seconds <= MAX_TTL:
        raise InputError(
            f"{field_name}: must be between {MIN_TTL} (1 hour) and {MAX_TTL} (10 years) or "
            f"null (never expires), got {ttl_seconds}"
        )
    return ttl_seconds


@dataclass
class CheckpointTtl:
    state: StateDir
    forget: Callable[[Path], None]  # drop anything cached from a deleted checkpoint dir
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def expiry(self, ttl_seconds: int | None) -> float | None:
        return None if ttl_seconds is None else self.state.clock() + ttl_seconds

    @contextmanager
    def saving(self, ref: CheckpointRef, ttl_seconds: int | None) -> Iterator[None]:
        """Around a save that publishes ``ref``: the expiry is on disk before the checkpoint is
        (a crash never leaves a checkpoint that should expire without its expiry), an expired
        copy at that name is deleted first (it must not come back under the new expiry), and a
        failed save puts the old expiry back."""
        with self._lock:
            if self.state.expired(ref):
                self._delete(ref)
            before = self.state.expires_at(ref)
            self.state.write_expiry(ref, self.expiry(ttl_seconds))
        try:
            yield
        except BaseException:
            with self._lock:
                exists = self.state.checkpoint_dir(ref).is_dir()
                self.state.write_expiry(ref, before if exists else None)
            raise

    def set(self, ref: CheckpointRef, ttl_seconds: int | None) -> None:
        """A new expiry, counted from now (None: never expires)."""
        with self._lock:
            self.state.write_expiry(ref, self.expiry(ttl_seconds))

    def delete(self, ref: CheckpointRef) -> None:
        with self._lock:
            self._delete(ref)

    def _delete(self, ref: CheckpointRef) -> None:
        """Under the lock. The directory goes first: a crash in between leaves an orphan expiry
        file (swept later), never a checkpoint that lost its expiry."""
        path = self.state.checkpoint_dir(ref)
        self.forget(path)
        if path.is_dir():
            remove_dir(path)
        self.state.write_expiry(ref, None)

    def sweep(self, run_id: str | None = None) -> list[str]:
        """Delete every expired checkpoint (of one run, or all), expiry files whose checkpoint
        is gone, and temp files of interrupted expiry writes; returns the deleted paths."""
        runs = self.state.root / "runs"
        run_dirs = [runs / run_id] if run_id is not None else sorted(runs.iterdir())
        deleted: list[str] = []
        for run_dir in run_dirs:
            for segment in SEGMENTS:
                for file in sorted((run_dir / segment).glob(".*")):
                    deleted += self._sweep_file(run_dir.name, segment, file)
        return deleted

    def _sweep_file(self, run_id: str, segment: str, file: Path) -> list[str]:
        with self._lock:
            if not file.is_file():
                return []  # a publish's temp dir, or already handled
            if not file.name.endswith(EXPIRY_SUFFIX):
                if f"{EXPIRY_SUFFIX}.tmp" in file.name:
                    file.unlink(missing_ok=True)  # writers hold the lock: this one died
                return []
            try:
                name = check_name(file.name[1 : -len(EXPIRY_SUFFIX)], "name")
            except InputError:
                return []
            ref = CheckpointRef(run_id, segment, name)
            if not self.state.checkpoint_dir(ref).is_dir():
                file.unlink(missing_ok=True)
                return []
            if not self.state.expired(ref):
                return []
            self._delete(ref)
        log.info("deleted expired checkpoint %s", ref.uri)
        return [ref.uri]

    def start(self, interval: float) -> threading.Event:
        """Sweep every ``interval`` seconds in a daemon thread; set the event to stop it."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval):
                try:
                    self.sweep()
                except Exception:  # keep sweeping: a failure here is retried next time
                    log.exception("checkpoint expiry sweep failed")

        threading.Thread(target=loop, name="checkpoint-ttl", daemon=True).start()
        return stop
