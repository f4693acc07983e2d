"""A server's listening socket, opened before anything heavy loads: a port in use or a host this
machine cannot listen on is one line naming ``--port`` or ``--host`` at once, instead of
uvicorn's ``[Errno 98]`` after the model has loaded. The socket is then the one uvicorn serves
(``furlong.serving.run_announced``), so nothing can take the port between the check and the
serve. Stdlib only: the CLI calls it before torch (or uvicorn) is imported.

The socket listens from here on, as under systemd's socket activation: a client that connects
while the model loads waits in the backlog and is answered once the server runs (the ready line
on stderr, or ``/healthz``, says when; a bare TCP connect does not)."""

from __future__ import annotations

import errno
import socket

from furlong.errors import InputError

BACKLOG = 2048  # uvicorn's default; its create_server listens again with its own


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host``:``port`` (IPv4 or IPv6, as ``host`` resolves; port 0:
    a free one, read back with ``getsockname``). Errors are :class:`InputError` naming the flag."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise InputError(f"--port: expected 0..65535 (0: any free port), got {port!r}")
    try:
        found = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (socket.gaierror, UnicodeError) as e:
        raise InputError(f"--host: cannot listen on {host!r} ({_reason(e)})") from None
    # a name's IPv4 address first, as uvicorn binds (AF_INET unless the host is IPv6)
    family, kind, proto, _, address = min(found, key=lambda info: info[0] != socket.AF_INET)
    sock = socket.socket(family, kind, proto)
    try:
        # as uvicorn: a restart may reuse the port while the last run's connections linger
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        raise _refusal(e, host, port) from None
    return sock


def where(host: str, port: int) -> str:
    """``host:port`` as a URL spells it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _refusal(e: OSError, host: str, port: int) -> InputError:
    at = where(host, port)
    if e.errno == errno.EADDRINUSE:
        return InputError(f"--port: {at} is in use (another server?); choose another --port")
    if e.errno == errno.EACCES:
        return InputError(f"--port: {at}: {_reason(e)} (a port below 1024 needs privileges)")
    return InputError(f"--host: cannot listen on {host!r} ({_reason(e)})")  # not this machine's


def _reason(e: Exception) -> str:
    return getattr(e, "strerror", None) or str(e)
