"""The servers' listening socket (furlong.listen): opened before anything loads, and refused in
one line naming --port or --host. That uvicorn then serves it: the ready-line tests of
tests/test_cli_model_names.py (all three servers, --port 0)."""

from __future__ import annotations

import socket

import pytest

from furlong.errors import InputError
from furlong.listen import bind


def test_port_zero_picks_a_free_port_that_then_is_in_use() -> None:
    with bind("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        assert port > 0
        with pytest.raises(InputError) as refused:
            bind("127.0.0.1", port)
    assert str(refused.value) == (
        f"--port: 127.0.0.1:{port} is in use (another server?); choose another --port"
    )


def test_a_port_held_by_another_program_is_refused() -> None:
    with socket.socket() as other:  # no SO_REUSEADDR, not listening: still the port's owner
        other.bind(("127.0.0.1", 0))
        port = other.getsockname()[1]
        with pytest.raises(InputError, match=rf"^--port: 127\.0\.0\.1:{port} is in use"):
            bind("127.0.0.1", port)


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 in this Python")
def test_an_ipv6_host_listens_on_ipv6() -> None:
    try:
        sock = bind("::1", 0)
    except InputError as e:  # a kernel without IPv6 says so in --host's words
        assert str(e).startswith("--host: cannot listen on '::1'")
        return
    with sock:
        assert sock.family == socket.AF_INET6
        port = sock.getsockname()[1]
        with pytest.raises(InputError, match=rf"^--port: \[::1\]:{port} is in use"):
            bind("::1", port)


@pytest.mark.parametrize(
    "host, port, message",
    [
        ("127.0.0.1", 65536, "--port: expected 0..65535 (0: any free port), got 65536"),
        ("127.0.0.1", -1, "--port: expected 0..65535 (0: any free port), got -1"),
        # TEST-NET-1 (RFC 5737): never an address of this machine, no name lookup
        ("192.0.2.1", 0, "--host: cannot listen on '192.0.2.1' (Cannot assign requested address)"),
    ],
)
def test_a_bad_port_or_host_names_the_flag(host: str, port: int, message: str) -> None:
    with pytest.raises(InputError) as refused:
        bind(host, port)
    assert str(refused.value) == message
