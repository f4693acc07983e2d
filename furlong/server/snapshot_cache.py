"""Rollout engines over sampler snapshots, loaded on demand and released within bounds.

A snapshot (``save_weights_for_sampler``) is files on disk; its engine is what sampling needs in
memory. Every sampler of one snapshot shares one engine. An engine is built on first use as a
work unit of the requesting tenant (``run``: the compute lane), never on the event loop and
never under a lock other work waits for; concurrent requests for one snapshot share one build.
Its size is known before it is built (``size``: a LoRA snapshot costs its adapter's tensors, a
full fine-tune its weights), and least-recently-used engines are released until it fits within
``max_bytes`` and ``max_engines``. Engines idle for ``idle_s`` and engines whose every user
(sampler) is gone are released too. A released engine is rebuilt from its files when it is used
again, so for a client a release is never an error.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from furlong.server.sample_feeder import FairFeeder

# runs ``build`` as ``owner``'s work and returns its future (the compute lane's submit)
Runner = Callable[[str, Callable[[], FairFeeder]], "Future[FairFeeder]"]


@dataclass
class _Entry:
    engine: Future[FairFeeder]
    nbytes: int
    last_used: float
    users: set[str] = field(default_factory=set)  # sampler ids that use it


class SnapshotCache:
    def __init__(
        self,
        build: Callable[[Path], FairFeeder],
        size: Callable[[Path], int],
        run: Runner,
        *,
        max_bytes: int,
        max_engines: int,
        idle_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._build, self._size, self._run = build, size, run
        self.max_bytes, self.max_engines, self.idle_s = max_bytes, max_engines, idle_s
        self.clock = clock
        self._lock = threading.Lock()  # held for bookkeeping only, never while building
        self._entries: OrderedDict[Path, _Entry] = OrderedDict()  # least recently used first
        self.builds = 0  # engines built so far (monitoring, tests)

    def engine(self, owner: str, path: Path, user: str | None = None) -> Future[FairFeeder]:
        """The engine of snapshot ``path`` (a done future when loaded, else its build)."""
        nbytes = self._size(path)  # a header read, before anything is allocated
        with self._lock:
            entry = self._entries.pop(path, None)
            build = entry is None
            if entry is None:
                self._make_room(nbytes)
                entry = _Entry(Future(), nbytes, 0.0)
                self.builds += 1
            entry.last_used = self.clock()
            if user is not None:
                entry.users.add(user)
            self._entries[path] = entry
        if build:  # outside the lock: a runner may run it (or fail) at once
            built = self._run(owner, lambda: self._build(path))
            built.add_done_callback(lambda f: self._settle(path, entry, f))
        return entry.engine

    def forget(self, path: Path) -> None:
        """Release ``path``'s engine now (the snapshot is being re-saved or deleted)."""
        with self._lock:
            self._entries.pop(path, None)

    def move(self, path: Path, to: Path) -> None:
        """``path``'s files now live at ``to``: so does its engine, if one is loaded."""
        with self._lock:
            entry = self._entries.pop(path, None)
            if entry is not None:
                self._entries[to] = entry

    def drop_users(self, users: Iterable[str]) -> int:
        """The samplers ``users`` are gone: release the engines no remaining sampler uses.
        Returns how many were released."""
        gone = set(users)
        with self._lock:
            unused = [p for p, e in self._entries.items() if e.users and e.users <= gone]
            for entry in self._entries.values():
                entry.users -= gone
            for path in unused:
                del self._entries[path]
            return len(unused)

    def release_idle(self) -> int:
        """Release the engines unused for ``idle_s`` seconds (none when it is 0)."""
        if self.idle_s <= 0:
            return 0
        cutoff = self.clock() - self.idle_s
        with self._lock:
            idle = [p for p, e in self._entries.items() if e.last_used < cutoff]
            for path in idle:
                del self._entries[path]
            return len(idle)

    def loaded(self) -> tuple[int, int]:
        """``(engines, bytes)`` held now."""
        with self._lock:
            return len(self._entries), sum(e.nbytes for e in self._entries.values())

    def _make_room(self, nbytes: int) -> None:
        """Release least-recently-used engines until one of ``nbytes`` fits (``_lock`` held).
        Requests already running on a released engine finish on it; a snapshot larger than the
        whole budget still gets an engine, alone."""
        held = sum(e.nbytes for e in self._entries.values())
        while self._entries and (
            held + nbytes > self.max_bytes or len(self._entries) >= self.max_engines
        ):
            _, oldest = self._entries.popitem(last=False)
            held -= oldest.nbytes

    def _settle(self, path: Path, entry: _Entry, built: Future[FairFeeder]) -> None:
        """The build's outcome; a failed build is not kept (the next request tries again)."""
        error = built.exception()
        if error is None:
            entry.engine.set_result(built.result())
            return
        with self._lock:
            if self._entries.get(path) is entry:
                del self._entries[path]
        entry.engine.set_exception(error)
