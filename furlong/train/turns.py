"""Cooperative turn points: where a long loss pass may let other work run.

The training engine calls :func:`turn_point` between microbatches. Outside a scheduler it does
nothing. A scheduler that shares one compute lane between tenants installs a hook with
:func:`yielding_to` on the thread running an operation, and the owner of shared state (a LoRA
model on a base other models train on too) wraps that hook with :func:`around_turns` to
release its lock while another tenant's unit runs and to restore its state afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_local = threading.local()


def _hooks() -> list[Callable[[], None]]:
    if not hasattr(_local, "hooks"):
        _local.hooks = []
    return _local.hooks


def turn_point() -> None:
    """Let other work run here if a scheduler asks for it (no-op otherwise)."""
    hooks = _hooks()
    if hooks:
        hooks[-1]()


@contextmanager
def yielding_to(hook: Callable[[], None]) -> Iterator[None]:
    """On this thread, ``turn_point()`` calls ``hook`` (which returns when it is our turn)."""
    hooks = _hooks()
    hooks.append(hook)
    try:
        yield
    finally:
        hooks.pop()


@contextmanager
def around_turns(before: Callable[[], None], after: Callable[[], None]) -> Iterator[None]:
    """While inside, a turn given away runs ``before()`` first and ``after()`` on return
    (e.g. release a lock, then take it back and re-activate an adapter)."""
    hooks = _hooks()
    if not hooks:  # no scheduler: turns are never given away
        yield
        return
    outer = hooks[-1]

    def hook() -> None:
        before()
        try:
            outer()
        finally:
            after()

    with yielding_to(hook):
        yield
