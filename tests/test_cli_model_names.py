"""Model names through the command line, as a new user types them (issue 26, items 2, 5, 6):
an unknown name exits 2 at once with one line naming the field (and the closest furlong model),
offline or with a hub that does not answer; the servers print a ready line whose URL answers;
`furlong serve` says where its state goes."""

from __future__ import annotations

import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
HANG_GUARD_S = 30  # a hang, not a timing: nothing asserts on wall-clock time
START_GUARD_S = 180  # a server's start (torch, the model) on a loaded 2-core machine
SERVE_HINT = "--base-model Qwen/Qwen3-8B-Base=tiny-qwen3"


def _env(home: Path, **extra: str) -> dict[str, str]:
    """Offline, with an empty HF cache: a developer's own cache cannot change the outcome."""
    env = dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        env.pop(var, None)
    return env | extra


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def _refused(args: list[str], env: dict[str, str]) -> str:
    """The one stderr line of a command that must exit 2 before doing anything."""
    done = subprocess.run(
        [sys.executable, "-m", "furlong", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


TYPOS = {
    "train": ["train", "model.name=tiny-qwen4", "run.steps=1"],
    "rollout-server": ["rollout-server", "--model", "tiny-qwen4"],
    "session-server": ["session-server", "--model", "tiny-qwen4", "--pause-mode", "abort"],
}
FIELDS = {"train": "model.name", "rollout-server": "--model", "session-server": "--model"}


@pytest.mark.parametrize("command", TYPOS)
def test_a_mistyped_preset_is_one_line_with_the_closest_name(tmp_path: Path, command: str) -> None:
    line = _refused(TYPOS[command], _env(tmp_path))
    assert line.startswith(f"furlong {command}: {FIELDS[command]}: 'tiny-qwen4' ")
    assert "did you mean 'tiny-qwen3'?" in line


def test_serve_refuses_an_uncached_hub_model_offline(tmp_path: Path) -> None:
    port = str(_free_port())
    line = _refused(["serve", "--base-model", "Qwen/Qwen3-8B-Base", "--port", port], _env(tmp_path))
    assert line.startswith("furlong serve: --base-model[0]: 'Qwen/Qwen3-8B-Base' ")
    assert "(HF_HUB_OFFLINE is set)" in line and SERVE_HINT in line


def test_serve_refuses_when_the_hub_does_not_answer(tmp_path: Path) -> None:
    """No offline flag: the hub endpoint is probed (here a loopback port nobody listens on)."""
    port, hub = str(_free_port()), _free_port()
    env = _env(tmp_path, HF_HUB_OFFLINE="", HF_ENDPOINT=f"http://127.0.0.1:{hub}", no_proxy="*")
    args = ["serve", "--base-model", "tiny-qwen3", "--base-model", "Qwen/Qwen3-8B-Base"]
    line = _refused([*args, "--port", port], env)
    assert line.startswith("furlong serve: --base-model[1]: ")
    assert f"no connection to 127.0.0.1:{hub}" in line and SERVE_HINT in line


@contextmanager
def _server(args: list[str], cwd: Path, ready: str) -> Iterator[re.Match[str]]:
    """``furlong ARGS --port 0`` until its stderr shows the line matching ``ready`` (whose
    group 1 is the URL); stopped afterwards."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "furlong", *args, "--port", "0"],
        cwd=cwd,
        env=_env(cwd / "hf"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:  # the pipe is drained to the end, so the server never blocks on it
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline, seen = time.monotonic() + START_GUARD_S, []
        while True:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert line is not None, "exited before its ready line:\n" + "\n".join(seen)
            seen.append(line)
            if match := re.fullmatch(ready, line):
                break
        assert "Traceback" not in "\n".join(seen)
        yield match
    finally:
        proc.terminate()
        proc.wait(timeout=HANG_GUARD_S)


URL = r"(http://127\.0\.0\.1:\d+)"


def test_serve_under_a_hub_name_starts_and_says_where_its_state_goes(tmp_path: Path) -> None:
    state = re.escape(str(tmp_path / "furlong-state"))
    ready = (
        rf"furlong serve: \['Qwen/Qwen3-8B-Base'\] on {URL} \(TINKER_BASE_URL\), "
        rf"state in {state} \(default: \./furlong-state; --state-dir to move it\)"
    )
    with _server(["serve", "--base-model", "Qwen/Qwen3-8B-Base=tiny-qwen3"], tmp_path, ready) as m:
        assert httpx.get(f"{m[1]}/api/v1/healthz").status_code == 200


def test_rollout_server_ready_line_names_a_url_that_answers(tmp_path: Path) -> None:
    ready = rf"furlong rollout-server: tiny-qwen3 on {URL} \(SGLang HTTP protocol\)"
    with _server(["rollout-server", "--model", "tiny-qwen3"], tmp_path, ready) as m:
        assert httpx.get(f"{m[1]}/health").status_code == 200


def test_session_server_ready_line_names_a_url_that_answers(tmp_path: Path) -> None:
    ready = (
        rf"furlong session-server: tiny-qwen3-moe on {URL} \(OpenAI-compatible /v1 per "
        rf"session: \1/sessions/\{{id\}}/v1\)"
    )
    args = ["session-server", "--pause-mode", "abort"]  # the default model
    with _server(args, tmp_path, ready) as m:
        assert httpx.get(f"{m[1]}/health").status_code == 200
