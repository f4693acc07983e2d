"""Pieces the furlong HTTP front ends share: reading a JSON object body, stopping a handler's
work when its client hangs up, running a server with a ready line once its port listens, and
running an ASGI app on 127.0.0.1 in a background thread (for tests, notebooks and examples
that want a real server without a second process)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import uvicorn

from furlong.errors import InputError
from furlong.listen import bind, where

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its reply; the handler's work was cancelled."""


async def read_json_object(
    request: Any, required: bool = True, allowed: Sequence[str] | None = None
) -> dict[str, Any]:
    """The request's JSON object body; an empty body is ``{}`` unless ``required``, and
    ``allowed`` rejects unknown keys. Errors are :class:`InputError` naming the body."""
    raw = await request.body()
    if not raw.strip():
        if required:
            raise InputError("body: expected a JSON object")
        return {}
    try:
        body = await request.json()
    except ValueError as exc:
        raise InputError(f"body: not JSON ({exc})") from None
    except RecursionError:  # arrays or objects nested deeper than the parser recurses
        raise InputError("body: JSON nested too deeply") from None
    if not isinstance(body, dict):
        raise InputError(f"body: expected a JSON object, got {type(body).__name__}")
    if allowed is not None:
        unknown = sorted(set(body) - set(allowed))
        if unknown:
            raise InputError(f"body: unknown fields {unknown}; expected some of {list(allowed)}")
    return body


async def unless_disconnected(request: Any, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` while watching the connection; when the client hangs up first, cancel
    ``work`` (which cleans up on ``CancelledError``) and raise :class:`ClientGone`. Starlette
    cancels nothing on a disconnect while a non-streaming handler runs; the body must already
    have been read, so that the next ASGI message can only be the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is stopping: the work stops with it
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):  # its outcome has nobody to go to
            await task
        raise ClientGone("the client disconnected")
    return task.result()


async def _disconnect(request: Any) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@contextmanager
def background_server(app: Callable[..., Any], host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``app`` on a free port; yields the base URL and shuts down afterwards."""
    sock = bind(host, 0)  # open before the server starts: no port race
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.01)
    try:
        yield f"http://{where(host, port)}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def run_announced(
    app: Any,
    host: str,
    port: int,
    ready: Callable[[str], str],
    sock: socket.socket | None = None,
) -> None:
    """``uvicorn.run(app, host=host, port=port)``, and ``ready(url)`` to stderr as soon as it
    serves (the URL has the bound port: ``port=0`` shows the one picked). ``sock``: the socket
    :func:`furlong.listen.bind` opened for ``host``:``port`` before the app was built (else it
    is opened here); a port in use is then an :class:`InputError` naming ``--port``."""
    if sock is None:
        sock = bind(host, port)
    bound = sock.getsockname()[1]

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)  # serves on sock, or exits (uvicorn logs why)
            if self.started:
                print(ready(f"http://{where(host, bound)}"), file=sys.stderr, flush=True)

    server = Server(uvicorn.Config(app, host=host, port=bound, log_level="warning"))
    with sock, contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run: Ctrl-C is a normal stop
        server.run(sockets=[sock])
    if not server.started:  # as uvicorn.run: a failed start exits 3
        sys.exit(3)
