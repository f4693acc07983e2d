"""The per-model command log: a training model's operations run strictly in ``seq_id`` order.

The SDK numbers every operation on a model (forward_backward chunks, optim_step, saves,
loads) and posts the chunks of one call concurrently, chunk 0 last, so arrival order is not
execution order. Operations wait in a reorder buffer until their turn; a resubmitted
``seq_id`` (the SDK retries with the same body) returns the original request id, and one with
a different body is a conflict (HTTP 409). A request refused at submission still consumes its
``seq_id`` (as a failed operation), so the model's next operation never waits for it. A
``seq_id`` far beyond the next expected one is refused without consuming anything (it could
only ever open a gap), and a gap that never fills fails the waiting operations after
``gap_timeout`` with an error the client sees.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from furlong.errors import InputError
from furlong.server.futures import Failure, FutureStore

_REMEMBERED = 10_000  # seq ids kept for dedupe


class Conflict(Exception):
    """A ``seq_id`` resent with a different body (HTTP 409)."""


@dataclass(frozen=True)
class _Slot:
    request_id: str
    fingerprint: bytes
    refusal: Exception | None = None  # why the submission was refused, if it was


class CommandLog:
    def __init__(
        self,
        store: FutureStore,
        executor: Executor,
        owner: str,
        first_seq: int = 1,
        gap_timeout: float = 600.0,
        max_ahead: int = 1 << 14,
    ):
        self.store = store
        self.executor = executor
        self.owner = owner
        self.next_seq = first_seq
        self.gap_timeout = gap_timeout
        self.max_ahead = max_ahead
        self._pending: dict[int, tuple[str, Callable[[], Any]]] = {}
        self._closing: tuple[str, Callable[[], Any]] | None = None  # the last op (``close``)
        self.closed = False
        self._seen: OrderedDict[int, _Slot] = OrderedDict()
        self._running = False
        self._gap_timer: asyncio.TimerHandle | None = None

    def replay(self, seq_id: int, fingerprint: bytes = b"") -> str | None:
        """The request id of an earlier submission of ``seq_id`` with the same body (its
        refusal is raised again), None for a new ``seq_id``; a different body is a
        :class:`Conflict`, and a ``seq_id`` already passed or too far ahead an ``InputError``."""
        slot = self._seen.get(seq_id)
        if slot is not None:
            if slot.fingerprint != fingerprint:
                raise Conflict(
                    f"seq_id: {seq_id} was already submitted with a different body; "
                    "a retry must resend the same request"
                )
            if slot.refusal is not None:
                raise slot.refusal
            return slot.request_id
        if seq_id < self.next_seq:
            raise InputError(f"seq_id: {seq_id} comes before the next operation {self.next_seq}")
        if seq_id > self.next_seq + self.max_ahead:
            raise InputError(
                f"seq_id: {seq_id} is more than {self.max_ahead} ahead of the next operation "
                f"{self.next_seq}"
            )
        return None

    def submit(self, seq_id: int, op: Callable[[], Any], fingerprint: bytes = b"") -> str:
        """Queue ``op`` (run on the executor in its turn); returns its request id."""
        known = self.replay(seq_id, fingerprint)
        if known is not None:
            return known
        return self._add(seq_id, op, _Slot(self.store.create(self.owner), fingerprint))

    def refuse(self, seq_id: int, error: Exception, fingerprint: bytes = b"") -> None:
        """Consume ``seq_id`` as a failed operation (the submission was refused with ``error``),
        when it is a new id within reach; otherwise there is nothing to consume."""
        try:
            if self.replay(seq_id, fingerprint) is not None:
                return
        except Exception:  # noqa: BLE001 - already used, passed or out of reach: not ours
            return
        failure = Failure(str(error.args[0]) if error.args else str(error), "user")
        self._add(seq_id, lambda: failure, _Slot(self.store.create(self.owner), fingerprint, error))

    @property
    def busy(self) -> bool:
        """An operation is running or waiting for its turn."""
        return self._running or bool(self._pending)

    def close(self, op: Callable[[], Any], reason: str) -> str:
        """End the log: the queued operations fail with ``reason``, later ones are refused, and
        ``op`` (the model's release) runs once the running operation is done. Its request id."""
        request_id = self.store.create(self.owner)
        self.closed = True
        if self._gap_timer is not None:
            self._gap_timer.cancel()
            self._gap_timer = None
        for seq in sorted(self._pending):
            self.store.resolve(self._pending.pop(seq)[0], Failure(reason, "user"))
        self._closing = (request_id, op)
        self._pump()
        return request_id

    def _add(self, seq_id: int, op: Callable[[], Any], slot: _Slot) -> str:
        if self.closed:
            raise InputError("model_id: the model was unloaded")
        self._seen[seq_id] = slot
        while len(self._seen) > _REMEMBERED:
            self._seen.popitem(last=False)
        self._pending[seq_id] = (slot.request_id, op)
        self._pump()
        return slot.request_id

    def _pump(self) -> None:
        if self._running:
            return
        if self._closing is not None:
            item: tuple[str, Callable[[], Any]] | None = self._closing
            self._closing = None
        else:
            item = self._pending.pop(self.next_seq, None)
        if item is None:
            if self._pending and self._gap_timer is None:
                loop = asyncio.get_running_loop()
                self._gap_timer = loop.call_later(self.gap_timeout, self._gap_expired)
            return
        if self._gap_timer is not None:
            self._gap_timer.cancel()
            self._gap_timer = None
        request_id, op = item
        self._running = True
        future = asyncio.get_running_loop().run_in_executor(self.executor, op)
        future.add_done_callback(lambda f: self._finished(request_id, f))

    def _finished(self, request_id: str, future: asyncio.Future) -> None:
        exc = future.exception()
        if exc is None:
            result = future.result()
        elif isinstance(exc, InputError):
            result = Failure(str(exc), "user")
        else:
            result = Failure(f"{type(exc).__name__}: {exc}", "server")
        self.store.resolve(request_id, result)
        self.next_seq += 1
        self._running = False
        self._pump()

    def _gap_expired(self) -> None:
        """The operation at ``next_seq`` never came: fail what waits behind it and move on."""
        self._gap_timer = None
        missing = self.next_seq
        for seq in sorted(self._pending):
            request_id, _ = self._pending.pop(seq)
            self.store.resolve(
                request_id,
                Failure(
                    f"seq_id {missing} never arrived within {self.gap_timeout:.0f} s, so "
                    f"operation {seq} cannot run in order; retry from a fresh client",
                    "user",
                ),
            )
            self.next_seq = seq + 1
