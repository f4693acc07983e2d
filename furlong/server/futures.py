"""Futures of the Tinker protocol: every long operation answers a request id at once and its
result is fetched by long-polling ``retrieve_future``.

Results stay retrievable until they expire by age (clients re-poll after their own timeouts),
a pending poll is held up to ``poll_timeout`` seconds and then answered ``try_again`` (never
instantly: the SDK re-polls without sleeping), and execution errors are results too
(``{"error", "category"}`` with HTTP 200, so the client stops polling and raises).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

Category = Literal["user", "server", "unknown"]


@dataclass(frozen=True)
class Failure:
    error: str
    category: Category = "user"


@dataclass
class _Entry:
    owner: str
    created: float
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: Any = None  # bytes (protobuf) | dict (JSON) | Failure


class FutureStore:
    """Request id → result, for one event loop; ``resolve`` may be called from any thread."""

    def __init__(self, poll_timeout: float = 25.0, ttl: float = 3600.0):
        self.poll_timeout = poll_timeout
        self.ttl = ttl
        self._entries: dict[str, _Entry] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def create(self, owner: str) -> str:
        """A new pending future owned by ``owner`` (call from the event loop)."""
        self._loop = asyncio.get_running_loop()
        self._expire()
        request_id = uuid.uuid4().hex
        self._entries[request_id] = _Entry(owner=owner, created=time.monotonic())
        return request_id

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the futures (and the command logs) live on, once one was created."""
        return self._loop

    def resolve(self, request_id: str, result: Any) -> None:
        """Set the result (bytes, a JSON dict or a :class:`Failure`); thread-safe."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._set, request_id, result)

    def _set(self, request_id: str, result: Any) -> None:
        entry = self._entries.get(request_id)
        if entry is not None and not entry.done.is_set():
            entry.result = result
            entry.done.set()

    def owner(self, request_id: str) -> str | None:
        entry = self._entries.get(request_id)
        return None if entry is None else entry.owner

    async def wait(self, request_id: str) -> tuple[bool, Any]:
        """``(True, result)`` once done, or ``(False, None)`` after ``poll_timeout``."""
        entry = self._entries[request_id]
        try:
            await asyncio.wait_for(asyncio.shield(entry.done.wait()), self.poll_timeout)
        except TimeoutError:
            return False, None
        return True, entry.result

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl
        for request_id in [k for k, e in self._entries.items() if e.created < cutoff]:
            if self._entries[request_id].done.is_set():
                del self._entries[request_id]
