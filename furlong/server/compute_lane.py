"""The compute lane every served training model shares, with fair turns between tenants.

One operation computes at a time (a second would only contend for the same cores and memory).
Each operation runs on its own thread but computes only while it holds the lane. Waiting
operations are served round-robin across tenants (FIFO within a tenant), and the operation
holding the lane passes it on at every turn point (between microbatches, see
``furlong.train.turns``) while someone waits. So a light request from one tenant waits for
at most one unit of another tenant's work, never for its whole queue.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from furlong.server.round_robin import RoundRobin
from furlong.train.turns import yielding_to


class _Ticket:
    __slots__ = ("tenant",)

    def __init__(self, tenant: str):
        self.tenant = tenant


class ComputeLane:
    def __init__(self, max_threads: int = 256):
        # threads only wait for the lane; one operation per model runs at a time (CommandLog)
        self._threads = ThreadPoolExecutor(max_threads, thread_name_prefix="furlong-train")
        self._cond = threading.Condition()
        self._holder: _Ticket | None = None
        self._waiting: RoundRobin[_Ticket] = RoundRobin()
        self.turns_passed = 0  # times a running operation let another tenant's unit in

    def executor(self, tenant: str) -> Executor:
        """An executor whose calls run on the lane as ``tenant``'s work."""
        return _TenantExecutor(self, tenant)

    def submit(self, tenant: str, fn: Callable[..., Any], *args: Any) -> Future:
        return self._threads.submit(self._run, tenant, fn, *args)

    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def shutdown(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _run(self, tenant: str, fn: Callable[..., Any], *args: Any) -> Any:
        ticket = _Ticket(tenant)
        self._acquire(ticket)
        try:
            with yielding_to(lambda: self._pass_turn(ticket)):
                return fn(*args)
        finally:
            with self._cond:
                self._holder = self._next()
                self._cond.notify_all()

    def _acquire(self, ticket: _Ticket) -> None:
        with self._cond:
            if self._holder is None and not self._waiting:
                self._holder = ticket
                return
            self._enqueue(ticket)
            while self._holder is not ticket:
                self._cond.wait()

    def _pass_turn(self, ticket: _Ticket) -> None:
        """At a turn point: queue behind whoever waits, and resume in our next turn."""
        with self._cond:
            if not self._waiting:
                return
            self._enqueue(ticket)
            self._holder = self._next()
            self.turns_passed += 1
            self._cond.notify_all()
            while self._holder is not ticket:
                self._cond.wait()

    def _enqueue(self, ticket: _Ticket) -> None:
        self._waiting.push(ticket.tenant, ticket)

    def _next(self) -> _Ticket | None:
        picked = self._waiting.pop()
        return None if picked is None else picked[1]


class _TenantExecutor(Executor):
    def __init__(self, lane: ComputeLane, tenant: str):
        self._lane = lane
        self._tenant = tenant

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if kwargs:
            return self._lane.submit(self._tenant, lambda: fn(*args, **kwargs))
        return self._lane.submit(self._tenant, fn, *args)
