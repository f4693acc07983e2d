"""Client sessions, their lifetime, and the error for whatever a tenant may not see.

A session scopes the ids a client makes in it (``<session>:train:<n>`` model ids and sampling
sessions). It lives while the client shows signs of life (the SDK heartbeats every 10 s; any
request naming the session counts too) and ends when the client finishes it or goes silent for
``timeout`` seconds. Ending a session is the service's business (service.py): its models are
unloaded and its samplers released; the saved checkpoints stay.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class NotFound(KeyError):
    """Unknown (or another tenant's) session, model, sampler or checkpoint → HTTP 404."""


@dataclass
class Session:
    owner: str
    last_seen: float
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None
    model_ids: list[str] = field(default_factory=list)
    sampler_ids: list[str] = field(default_factory=list)


class Sessions:
    def __init__(self, timeout: float = 0.0, clock: Callable[[], float] = time.monotonic):
        """``timeout``: seconds of silence after which a session expires (0: never)."""
        self.timeout = timeout
        self.clock = clock
        self._lock = threading.Lock()  # the reaper thread ends sessions too
        self._live: dict[str, Session] = {}

    def create(
        self,
        owner: str,
        user_metadata: dict[str, Any] | None = None,
        display_name: str | None = None,
    ) -> str:
        session_id = f"s{uuid.uuid4().hex[:12]}"
        metadata = (
            None if user_metadata is None else {str(k): str(v) for k, v in user_metadata.items()}
        )
        with self._lock:
            self._live[session_id] = Session(owner, self.clock(), metadata, display_name)
        return session_id

    def check(self, owner: str, session_id: str) -> Session:
        """The live session ``session_id`` of ``owner`` (a sign of life: it is touched)."""
        with self._lock:
            session = self._live.get(session_id)
            if session is None or session.owner != owner:
                raise NotFound(f"session {session_id!r} (unknown, or ended)")
            session.last_seen = self.clock()
            return session

    def touch(self, session_id: str) -> None:
        """A sign of life from a request that names something of the session."""
        with self._lock:
            session = self._live.get(session_id)
            if session is not None:
                session.last_seen = self.clock()

    def add_model(self, session_id: str, model_id: str) -> None:
        with self._lock:
            self._live[session_id].model_ids.append(model_id)

    def add_sampler(self, session_id: str, sampler_id: str) -> None:
        with self._lock:
            session = self._live.get(session_id)
            if session is not None:
                session.sampler_ids.append(sampler_id)

    def end(self, session_id: str) -> Session | None:
        """Remove a live session; returns it (None if it had already ended)."""
        with self._lock:
            return self._live.pop(session_id, None)

    def silent(self) -> list[str]:
        """The sessions silent for longer than ``timeout`` (none when it is 0)."""
        if self.timeout <= 0:
            return []
        cutoff = self.clock() - self.timeout
        with self._lock:
            return [sid for sid, s in self._live.items() if s.last_seen < cutoff]

    def models(self, session_id: str) -> list[str]:
        with self._lock:
            session = self._live.get(session_id)
            return [] if session is None else list(session.model_ids)

    def owned(self, owner: str) -> list[str]:
        with self._lock:
            return [sid for sid, s in self._live.items() if s.owner == owner]
