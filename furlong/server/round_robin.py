"""Per-tenant FIFO queues served round-robin: the one fairness rule of the compute lane and
the sample feeders."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, TypeVar

T = TypeVar("T")


class RoundRobin(Generic[T]):
    """Not thread-safe: callers hold their own lock."""

    def __init__(self) -> None:
        self._queues: OrderedDict[str, deque[T]] = OrderedDict()

    def push(self, tenant: str, *items: T) -> None:
        self._queues.setdefault(tenant, deque()).extend(items)

    def pop(self) -> T:
        """The oldest item of the first tenant in line; that tenant goes to the back."""
        tenant, queue = next(iter(self._queues.items()))
        item = queue.popleft()
        del self._queues[tenant]
        if queue:
            self._queues[tenant] = queue
        return item

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return bool(self._queues)
