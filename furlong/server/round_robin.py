"""Per-tenant FIFO queues served round-robin: the one fairness rule of the compute lane and
the sample feeders."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class RoundRobin(Generic[T]):
    """Not thread-safe: callers hold their own lock."""

    def __init__(self) -> None:
        self._queues: OrderedDict[str, deque[T]] = OrderedDict()

    def push(self, tenant: str, *items: T) -> None:
        self._queues.setdefault(tenant, deque()).extend(items)

    def pop(self, eligible: Callable[[str], bool] | None = None) -> tuple[str, T] | None:
        """``(tenant, item)``: the oldest item of the first tenant in line that is ``eligible``
        (all are by default); that tenant goes to the back. None when no tenant is."""
        tenant = next((t for t in self._queues if eligible is None or eligible(t)), None)
        if tenant is None:
            return None
        queue = self._queues[tenant]
        item = queue.popleft()
        del self._queues[tenant]
        if queue:
            self._queues[tenant] = queue
        return tenant, item

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return bool(self._queues)
