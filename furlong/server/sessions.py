"""Client sessions, and the error for whatever a tenant may not see.

A session only scopes the ids a client makes in it (``<session>:train:<n>`` model ids and
sampling sessions); nothing else hangs off it.
"""

from __future__ import annotations

import uuid


class NotFound(KeyError):
    """Unknown (or another tenant's) session, model, sampler or checkpoint → HTTP 404."""


class Sessions:
    def __init__(self) -> None:
        self._owners: dict[str, str] = {}  # session id -> owner

    def create(self, owner: str) -> str:
        session_id = f"s{uuid.uuid4().hex[:12]}"
        self._owners[session_id] = owner
        return session_id

    def check(self, owner: str, session_id: str) -> None:
        if self._owners.get(session_id) != owner:
            raise NotFound(f"session {session_id!r}")
