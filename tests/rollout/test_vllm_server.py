"""The watchdog a vLLM server runs under (furlong/rollout/vllm_server.py): a server never
outlives the process that started it, however that process ended, and a stop lets the server
shut down before its group is killed. A stand-in server (a Python that forks a child, as vLLM
forks its engine) keeps it fast."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from furlong.rollout.vllm_server import WATCHDOG, UnsupportedCPU, VLLMServer

# a "server" that forks a worker and would run for 100 s
SERVER = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(100)']); time.sleep(100)"
)


def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,pgid=,stat="], capture_output=True, text=True)
    rows = [line.split() for line in out.stdout.splitlines()]
    return [int(p) for p, g, stat in rows if int(g) == pgid and not stat.startswith("Z")]


def _watch(owner: int) -> subprocess.Popen:
    args = [sys.executable, "-c", WATCHDOG, str(owner), "5", sys.executable, "-c", SERVER]
    watchdog = subprocess.Popen(args, start_new_session=True)
    deadline = time.monotonic() + 10
    while len(_group(watchdog.pid)) < 3:  # the watchdog, the server, its worker
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return watchdog


def _gone(pgid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while _group(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_the_server_goes_with_its_owner_however_the_owner_ends():
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(100)"])
    watchdog = _watch(owner.pid)
    os.kill(owner.pid, signal.SIGKILL)  # no atexit, no cleanup: as the OOM killer ends it
    owner.wait()
    assert _gone(watchdog.pid, within=10)
    watchdog.wait(5)


def test_a_stop_ends_the_server_and_its_worker():
    watchdog = _watch(os.getpid())
    watchdog.terminate()  # what VLLMServer.stop sends
    assert _gone(watchdog.pid, within=10)
    watchdog.wait(5)


def _fake_python(tmp_path, server: str) -> Path:
    """A Python that runs the watchdog for real and, as the server (``-m ...``), ``server``."""
    path = tmp_path / "python"
    path.write_text(
        f'#!/bin/sh\nif [ "$1" = "-m" ]; then {server}; fi\nexec {sys.executable} "$@"\n'
    )
    path.chmod(0o755)
    return path


def test_a_server_that_dies_starting_is_named_with_its_log(tmp_path):
    server = VLLMServer(_fake_python(tmp_path, "echo no vllm here >&2; exit 3"), tmp_path)
    with pytest.raises(RuntimeError, match=r"(?s)exited while starting.*no vllm here"):
        server.start(timeout=30)
    assert "exited with code 3" in server.log_tail()


def test_sigill_while_starting_says_the_cpu_lacks_an_instruction(tmp_path):
    server = VLLMServer(_fake_python(tmp_path, "kill -ILL $$"), tmp_path)
    with pytest.raises(UnsupportedCPU, match=r"SIGILL .* CPU flags: avx2="):
        server.start(timeout=30)
