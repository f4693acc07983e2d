"""The per-model command log: a training model's operations run strictly in ``seq_id`` order.

The SDK numbers every operation on a model (forward_backward chunks, optim_step, saves,
loads) and posts the chunks of one call concurrently, chunk 0 last, so arrival order is not
execution order. Operations wait in a reorder buffer until their turn; a resubmitted
``seq_id`` (the SDK retries with the same body) returns the original request id; a gap that
never fills fails the waiting operations after ``gap_timeout`` with an error the client sees.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from furlong.errors import InputError
from furlong.server.futures import Failure, FutureStore

_REMEMBERED = 10_000  # seq ids kept for dedupe


class CommandLog:
    def __init__(
        self,
        store: FutureStore,
        executor: Executor,
        owner: str,
        first_seq: int = 1,
        gap_timeout: float = 600.0,
    ):
        self.store = store
        self.executor = executor
        self.owner = owner
        self.next_seq = first_seq
        self.gap_timeout = gap_timeout
        self._pending: dict[int, tuple[str, Callable[[], Any]]] = {}
        self._seen: OrderedDict[int, str] = OrderedDict()
        self._running = False
        self._gap_timer: asyncio.TimerHandle | None = None

    def submit(self, seq_id: int, op: Callable[[], Any]) -> str:
        """Queue ``op`` (run on the executor in its turn); returns its request id."""
        if seq_id in self._seen:
            return self._seen[seq_id]
        if seq_id < self.next_seq:
            raise InputError(f"seq_id: {seq_id} comes before the next operation {self.next_seq}")
        request_id = self.store.create(self.owner)
        self._seen[seq_id] = request_id
        while len(self._seen) > _REMEMBERED:
            self._seen.popitem(last=False)
        self._pending[seq_id] = (request_id, op)
        self._pump()
        return request_id

    def _pump(self) -> None:
        if self._running:
            return
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
