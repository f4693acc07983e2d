"""Fair sampling: one rollout engine fed from per-tenant queues in bounded waves.

The engine batches continuously but queues FIFO, so a tenant asking for 20,000 samples would
hold everyone else behind its whole request. The feeder keeps at most ``window`` sequences
in the engine (one full batch) and, each time one finishes, submits the next sequence of the
next tenant in round-robin order. One tenant may hold all but ``reserved`` of the slots, so
another tenant's request starts at the next decode step instead of waiting for one of the
first tenant's sequences to end (which can take thousands of steps).
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from furlong.rollout.base import SamplingEngine
from furlong.rollout.sampling import SamplingParams
from furlong.server.round_robin import RoundRobin


@dataclass
class _Item:
    prompt: Sequence[int]
    params: SamplingParams
    future: Future = field(default_factory=Future)


class FairFeeder:
    def __init__(self, engine: SamplingEngine, window: int | None = None, reserved: int = 1):
        self.engine = engine
        self.window = window or engine.max_running
        self.per_tenant = max(1, self.window - reserved)  # slots one tenant may hold
        self._lock = threading.Lock()
        self._queues: RoundRobin[_Item] = RoundRobin()
        self._in_flight = 0
        self._held: Counter[str] = Counter()  # in-flight sequences per tenant

    def submit(
        self, tenant: str, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> list[Future]:
        """Queue a whole request (validated whole first); one future per sequence."""
        self.engine.check_requests(prompts, params)
        items = [_Item(p, sp) for p, sp in zip(prompts, params, strict=True)]
        with self._lock:
            self._queues.push(tenant, *items)
        self._pump()
        return [item.future for item in items]

    def queued(self) -> int:
        with self._lock:
            return len(self._queues)

    def _pump(self) -> None:
        while True:
            with self._lock:
                if self._in_flight >= self.window:
                    return
                picked = self._queues.pop(lambda t: self._held[t] < self.per_tenant)
                if picked is None:
                    return
                tenant, item = picked
                self._in_flight += 1
                self._held[tenant] += 1
            try:
                inner = self.engine.submit(item.prompt, item.params)
            except Exception as exc:  # noqa: BLE001 - the sequence's own future reports it
                self._finish(tenant, item, None, exc)
                continue
            inner.add_done_callback(functools.partial(self._finish, tenant, item, exc=None))

    def _finish(
        self, tenant: str, item: _Item, inner: Future | None, exc: BaseException | None
    ) -> None:
        with self._lock:
            self._in_flight -= 1
            self._held[tenant] -= 1
        if inner is not None:
            exc = inner.exception()
        if exc is not None:
            item.future.set_exception(exc)
        else:
            assert inner is not None
            item.future.set_result(inner.result())
        self._pump()
