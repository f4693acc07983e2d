"""`furlong serve` as a real subprocess on a free loopback port, for the tests that go through
the command line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


@contextmanager
def cli_server(args: list[str], start_timeout: float = 120.0) -> Iterator[str]:
    """``furlong serve ARGS --port P`` (offline, one thread); yields its URL once healthy."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "furlong", "serve", "--port", str(port), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                if httpx.get(f"{url}/api/v1/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
