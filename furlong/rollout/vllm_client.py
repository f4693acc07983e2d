"""``rollout.engine = "vllm"``: vLLM servers generating for the RL loop, the session server and
the Tinker sampler.

The servers are given by URL (``rollout.urls``: started by the user with the flags
:mod:`furlong.rollout.vllm_server` uses) or started here from a named Python
(``rollout.vllm_python``: the venv ``make vllm-venv`` builds) on the policy's weights, saved
as an HF directory. Each prompt is one token-in, token-out ``/inference/v1/generate`` call
(:mod:`furlong.rollout.vllm_wire`), sent concurrently so vLLM batches them continuously.

Weights move through one seam, :meth:`VLLMClient.update_weights`, with two transports:

- ``disk`` (any device; the CPU's only one): ``/pause?mode=wait`` (requests in flight finish
  under the old weights), the weights as one safetensors file in ``staging_dir`` (default
  ``/dev/shm``, memory-backed), ``/collective_rpc reload_weights`` (vLLM's in-place reload),
  ``/update_weight_version``, ``/reset_prefix_cache``, ``/resume``.
- ``nccl`` (GPU): vLLM's native four-phase API through vLLM's own trainer-side engine
  (:mod:`furlong.rollout.vllm_nccl`). Not validated here: no GPU.

Every result carries the weight version its tokens came from (vLLM's ``weight_versions``
spans); a result that spans two is refused (:func:`vllm_wire.weight_version`), and the publish
order above makes it impossible. ``check_served`` compares what vLLM serves with the
trainer's weights: the tensors vLLM can checksum (``/weight_checker``) byte for byte.

Several clients may share one server (the Tinker service builds one engine per snapshot): the
server holds one client's weights at a time, and a client whose weights are not loaded waits
for the requests in flight to finish, then loads its own (:class:`_Fleet`).
"""

from __future__ import annotations

import atexit
import hashlib
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import torch
from safetensors.torch import save_file

from furlong.errors import InputError
from furlong.rollout import vllm_wire as wire
from furlong.rollout.base import (
    GenerateResult,
    MemoryBytes,
    MemoryTag,
    PauseMode,
    RolloutEngine,
    SamplingEngine,
    SessionEngine,
    Weights,
    check_pause_mode,
    check_url,
    check_weight_shapes,
    expand_params,
    no_memory,
)
from furlong.rollout.model_runner import read_weights
from furlong.rollout.registry import EngineRequest
from furlong.rollout.sampling import SamplingParams
from furlong.rollout.vllm_model import architecture, save_model_dir, served_weights, tied_head

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from furlong.rollout.vllm_server import VLLMServer

TRANSPORTS = ("disk", "nccl")
SHM = Path("/dev/shm")  # the default staging root: memory, readable by local servers
STAGING_PREFIX = "furlong-vllm-"  # + pid: a fleet's directory under the staging root
# furlong's pause modes as vLLM's: "retract" (requeue and recompute under the new weights)
# has no vLLM counterpart, and "wait" (finish under the old ones) is what publication uses
_PAUSE = {"abort": "abort", "in_place": "keep"}


def check_options(urls: Sequence[str], python: str, transport: str, flags: bool = False) -> None:
    """The kind's own config rules, checked without contacting anything; errors name the
    ``rollout.*`` fields, or with ``flags`` the command-line flags."""
    where = "--rollout-url / --vllm-python" if flags else "rollout.urls / rollout.vllm_python"
    if bool(urls) == bool(python):
        raise InputError(
            f"{where}: the vLLM engine needs exactly one: the URLs of running vLLM servers, or "
            'the Python to start one with ("auto": the venv `make vllm-venv` builds)'
        )
    if transport not in TRANSPORTS:
        raise InputError(f"rollout.vllm_transport: {transport!r} is not one of {list(TRANSPORTS)}")


@dataclass(frozen=True)
class NoRouter:
    """vLLM's kind serves dense models here (MoE routes for R3 come from the embedded engine)."""

    @property
    def is_moe(self) -> bool:
        return False


class VLLMClient:
    tokenizer: Any
    context_length: int | None

    def __init__(
        self,
        fleet: _Fleet,
        weights: Mapping[str, torch.Tensor],
        *,
        tokenizer: Any,
        eos_ids: Iterable[int],
        vocab_size: int,
        max_running: int = 32,
        transport: str = "disk",
        tied: tuple[str, str] | None = None,
    ):
        """Use :meth:`from_request` (it starts or checks the servers); ``weights``: the full
        set the servers are to serve (copied: this client owns them)."""
        self._fleet = fleet
        self.tokenizer = tokenizer
        self.context_length = fleet.context_length
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self._vocab = int(vocab_size)
        self._max_running = max_running
        self._weights = {
            k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights.items()
        }
        self._transport = transport
        self._tied = tied  # (embedding, head): the head follows the embedding (tied_head)
        self._version = 0
        self._dir: Path | None = None  # this client's weights as the servers load them
        self._pool = ThreadPoolExecutor(max_running * len(fleet.urls), thread_name_prefix="vllm")
        self._lock = threading.Lock()
        self._placed: dict[str, int] = {}  # request id -> server, while in flight
        self.sync_seconds: list[float] = []  # each publication's wall time (benchmarks read it)
        self._nccl: Any = None

    @classmethod
    def from_request(cls, request: EngineRequest) -> VLLMClient:
        """The registry's ``vllm`` kind. Options (each the ``rollout.*`` field of that name):
        ``urls`` or ``vllm_python``, ``staging_dir``, ``timeout``, ``vllm_transport``,
        ``vllm_threads``. The policy's weights become version 0 on every server."""
        o = request.options
        urls = [check_url(u, f"rollout.urls[{i}]") for i, u in enumerate(o.get("urls") or ())]
        python, transport = str(o.get("vllm_python") or ""), str(o.get("vllm_transport") or "disk")
        check_options(urls, python, transport)
        policy = request.model
        _refuse_moe(policy)
        weights = served_weights(policy)
        fleet = _Fleet.connect(
            urls,
            python,
            policy,
            request.tokenizer,
            staging_dir=o.get("staging_dir") or None,
            timeout=float(o.get("timeout") or 600.0),
            threads=o.get("vllm_threads"),
        )
        client = cls(
            fleet,
            weights,
            tokenizer=request.tokenizer,
            eos_ids=_eos_ids(policy),
            vocab_size=int(policy.get_output_embeddings().out_features),
            max_running=max(1, math.ceil(request.max_running / len(fleet.urls))),
            transport=transport,
            tied=tied_head(policy),
        )
        try:
            fleet.check_names(client._weights, client._tied)
            client._publish(0)
        except BaseException:
            client.close()
            raise
        return client

    # ---------------------------------------------------------------- the served model

    @property
    def router(self) -> NoRouter:
        return NoRouter()

    @property
    def max_running(self) -> int:
        return self._max_running

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def urls(self) -> list[str]:
        return self._fleet.urls

    @property
    def staging_dir(self) -> Path:
        """Where published weights are written for the servers to read."""
        return self._fleet.staging

    # ---------------------------------------------------------------- generation

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerateResult]:
        plist = expand_params(len(prompts), params)
        checked = [self._check(i, prompts[i], plist[i]) for i in range(len(plist))]
        jobs = [self._send(i, checked[i], plist[i], None) for i in range(len(plist))]
        return [job.result() for job in jobs]

    def check_requests(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> None:
        plist = expand_params(len(prompts), params)
        for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
            self._check(i, prompt, p)

    def submit(
        self, prompt: Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> Future[GenerateResult]:
        return self._send(0, self._check(0, prompt, params), params, request_id)

    def _check(self, index: int, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise InputError(f"params[{index}]: expected SamplingParams, got {type(params)}")
        wire.check_supported(index, params)
        ids = [int(t) for t in prompt]
        if not ids:
            raise InputError(f"prompts[{index}]: empty")
        bad = next((j for j, t in enumerate(ids) if not 0 <= t < self._vocab), None)
        if bad is not None:
            raise InputError(
                f"prompts[{index}][{bad}]: id {ids[bad]} is outside [0, {self._vocab})"
            )
        context = self.context_length
        if context is not None and len(ids) + params.max_tokens > context:
            raise InputError(
                f"params[{index}].max_tokens: {len(ids)} prompt tokens + max_tokens "
                f"{params.max_tokens} exceed the served context of {context}"
            )
        return ids

    def _send(
        self, index: int, prompt: list[int], params: SamplingParams, request_id: str | None
    ) -> Future[GenerateResult]:
        return self._pool.submit(self._generate_one, index, prompt, params, request_id)

    def _generate_one(
        self, index: int, prompt: list[int], params: SamplingParams, request_id: str | None
    ) -> GenerateResult:
        body = wire.request_body(prompt, params, self.eos_ids, request_id)
        with self._fleet.serving(self) as server:
            if request_id is not None:
                with self._lock:
                    self._placed[request_id] = server
            try:
                reply = self._fleet.post(
                    server, "/inference/v1/generate", body, f"prompts[{index}]"
                )
            finally:
                if request_id is not None:
                    with self._lock:
                        self._placed.pop(request_id, None)
        result = wire.generate_result(reply, prompt, params, request_id or index)
        if result.weight_version < 0:  # aborted before its first token: no span to read
            result = replace(result, weight_version=self._version)
        return result

    # ---------------------------------------------------------------- weights

    @property
    def weight_version(self) -> int:
        return self._version

    def check_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        check_weight_shapes(weights, {k: list(v.shape) for k, v in self._weights.items()})

    def update_weights(self, weights: Weights, version: int | None = None) -> int:
        """Publish to every server (tensors, or a safetensors file / directory of them) as
        ``version`` (default: the next); returns it. Weights not named keep their values."""
        new = read_weights(weights)
        self.check_weights(new)
        for name, tensor in new.items():
            self._weights[name].copy_(tensor.detach())
        if self._tied is not None and self._tied[0] in new and self._tied[1] not in new:
            self._weights[self._tied[1]].copy_(self._weights[self._tied[0]])
        return self._publish(self._version + 1 if version is None else int(version))

    def _publish(self, version: int) -> int:
        if self._transport == "nccl":
            from furlong.rollout import vllm_nccl

            self._nccl = self._nccl or vllm_nccl.NcclSync(self._fleet.urls, self._weights)
            self.sync_seconds.append(self._nccl.send(version))
            self._version = version
            return version
        old = self._dir
        self._dir = self._fleet.write(self._weights)
        try:
            self.sync_seconds.append(self._fleet.load(self, self._dir, version))
        except BaseException:
            self._fleet.discard(self._dir)
            self._dir = old
            raise
        self._version = version
        if old is not None:
            self._fleet.discard(old)
        return version

    def reload_if_needed(self) -> None:
        """This client's weights onto the servers if another client's are there."""
        assert self._dir is not None
        self._fleet.load(self, self._dir, self._version)

    def check_served(self) -> dict[str, Any]:
        """What the servers hold against this client's weights: vLLM's own checksums
        (``/weight_checker``) of every tensor it can read (``compared``, of ``served``: the CPU
        backend packs linear layers away and reports them empty), and the names that differ
        (``mismatched``: empty when they are equal)."""
        return self._fleet.check_served(self._weights)

    # ---------------------------------------------------------------- control

    def abort(self, request_ids: Iterable[int | str] | None = None) -> int:
        """Requests by id (they end with their partial output, finish reason ``abort``), or
        every request in flight."""
        if request_ids is None:
            self._fleet.on_all("/abort_requests", {})
            return -1
        ids = [str(r) for r in request_ids]
        with self._lock:
            placed = {r: self._placed.get(r) for r in ids}
        for server in range(len(self.urls)):
            mine = [wire.served_id(r) for r, s in placed.items() if s in (None, server)]
            if mine:
                self._fleet.post(server, "/abort_requests", {"request_ids": mine}, "abort")
        return len(ids)

    def pause(self, mode: PauseMode = "retract") -> None:
        mode = check_pause_mode(mode)
        if mode not in _PAUSE:
            raise InputError(
                f"mode: {mode!r} has no vLLM counterpart (it requeues requests under the new "
                f'weights); use "abort" or "in_place" (vLLM\'s "keep")'
            )
        self._fleet.on_all("/pause", None, params={"mode": _PAUSE[mode]})

    def resume(self) -> None:
        self._fleet.on_all("/resume", None)

    def offload(self, tags: Iterable[MemoryTag]) -> None:
        raise InputError(
            'colocate: vLLM\'s CPU worker ignores sleep/wake_up; rollout.engine = "vllm" '
            "cannot hand its memory to the trainer (use the embedded engine)"
        )

    def onload(self, tags: Iterable[MemoryTag]) -> None:
        self.offload(tags)

    def memory_bytes(self) -> MemoryBytes:
        return no_memory()  # the servers' memory is theirs

    def metrics(self) -> dict[str, float]:
        return {"weight_sync_s:mean": self.sync_seconds[-1]} if self.sync_seconds else {}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._dir is not None:
            self._fleet.discard(self._dir)
            self._dir = None
        self._fleet.release(self)

    def __enter__(self) -> VLLMClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Fleet:
    """The servers behind one or more clients: connections, the servers furlong started, the
    staging directory, and which client's weights are loaded."""

    _shared: dict[tuple, _Fleet] = {}
    _shared_lock = threading.Lock()

    def __init__(
        self,
        urls: list[str],
        servers: list[VLLMServer],
        staging: Path,
        timeout: float,
        context_length: int | None,
    ):
        self.urls, self._servers = urls, servers
        self._http = [httpx.Client(base_url=u, timeout=timeout) for u in urls]
        self.staging = staging  # this fleet's own directory (_staging), removed at release
        atexit.register(self._remove_staging)  # or at exit: a front door may never release
        self.context_length = context_length
        self._cond = threading.Condition()
        self._holder: VLLMClient | None = None  # whose weights the servers hold
        self._in_flight = 0
        self._users = 0
        self._key: tuple = ()
        self._served_names: list[set[str]] | None = None  # per server, asked once

    @classmethod
    def connect(
        cls,
        urls: list[str],
        python: str,
        policy: PreTrainedModel,
        tokenizer: Any,
        *,
        staging_dir: str | os.PathLike | None,
        timeout: float,
        threads: int | None,
    ) -> _Fleet:
        """The fleet at ``urls``, or the one started from ``python`` for this architecture
        (shared: the Tinker service's snapshot engines all sample on one server)."""
        key = (tuple(urls), python, architecture(policy), str(staging_dir))
        with cls._shared_lock:
            fleet = cls._shared.get(key)
            if fleet is None:
                fleet = cls._start(urls, python, policy, tokenizer, staging_dir, timeout, threads)
                fleet._key = key
                cls._shared[key] = fleet
            fleet._users += 1
        return fleet

    @classmethod
    def _start(
        cls,
        urls: list[str],
        python: str,
        policy: PreTrainedModel,
        tokenizer: Any,
        staging_dir: str | os.PathLike | None,
        timeout: float,
        threads: int | None,
    ) -> _Fleet:
        from furlong.rollout.vllm_server import VLLMServer
        from furlong.rollout.vllm_venv import resolve_python

        staging = _staging(staging_dir, urls)
        context = int(getattr(policy.config, "max_position_embeddings", 4096) or 4096)
        servers: list[VLLMServer] = []
        if not urls:
            exe = resolve_python(python)
            model_dir = Path(tempfile.mkdtemp(prefix="model-", dir=_mkdir(staging)))
            try:
                save_model_dir(policy, tokenizer, model_dir)
                context = min(context, 4096)
                server = VLLMServer(exe, model_dir, max_model_len=context, threads=threads)
                servers.append(server.start())
            finally:
                shutil.rmtree(model_dir, ignore_errors=True)  # loaded: weights come by reload
            urls = [s.url for s in servers]
        else:
            context = min(_served_context(urls, timeout))
        return cls(urls, servers, staging, timeout, context)

    # ---------------------------------------------------------------- requests

    @contextmanager
    def serving(self, client: VLLMClient) -> Iterator[int]:
        """A request of ``client``'s, on the server with the fewest in flight, once the servers
        hold its weights (another client's requests finish first, then its weights load)."""
        with self._cond:
            while self._holder is not client and self._in_flight:
                self._cond.wait()
            if self._holder is not client:
                client.reload_if_needed()  # reentrant: load() takes the condition again
            self._in_flight += 1
            server = self._in_flight % len(self.urls)
        try:
            yield server
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    def post(self, server: int, path: str, body: Any, where: str, params: Any = None) -> Any:
        try:
            response = self._http[server].post(path, json=body, params=params)
        except httpx.HTTPError as e:
            raise RuntimeError(f"{where}: {self.urls[server]}{path} failed: {e}") from e
        if response.status_code in (400, 422):  # vLLM names the bad field
            raise InputError(f"{where}: {self.urls[server]} refused it: {_message(response)}")
        if response.status_code == 403 and "scale-out" in response.text.lower():
            raise InputError(
                f"rollout.urls[{server}]: {self.urls[server]} serves without the token-in, "
                "token-out routes; start it with --enable-scale-out (docs/rollout.md)"
            )
        if response.status_code == 404:
            raise InputError(
                f"rollout.urls[{server}]: {self.urls[server]} has no {path}; start it with "
                "VLLM_SERVER_DEV_MODE=1 and --enable-scale-out (vLLM >= 0.32, docs/rollout.md)"
            )
        if response.status_code != 200:
            raise RuntimeError(
                f"{where}: {self.urls[server]}{path} returned {response.status_code}: "
                f"{response.text[:500]}"
            )
        return response.json() if response.content else None

    def on_all(self, path: str, body: Any, params: Any = None) -> list[Any]:
        return [self.post(i, path, body, path.strip("/"), params) for i in range(len(self.urls))]

    # ---------------------------------------------------------------- weights

    def write(self, weights: Mapping[str, torch.Tensor]) -> Path:
        """The weights as one safetensors file in a fresh directory under the staging root."""
        path = Path(tempfile.mkdtemp(prefix="weights-", dir=_mkdir(self.staging)))
        try:
            save_file(dict(weights), str(path / "model.safetensors"))
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return path

    def load(self, client: VLLMClient, path: Path, version: int) -> float:
        """``client``'s weights at ``path`` onto every server as ``version``: requests in
        flight finish first (under the old weights), then the reload; seconds it took."""
        with self._cond:
            while self._in_flight:
                self._cond.wait()
            tick = time.perf_counter()
            self.on_all("/pause", None, params={"mode": "wait"})
            try:
                rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
                self.on_all("/collective_rpc", rpc)
                self.on_all("/update_weight_version", {"new_version": str(version)})
                self.on_all("/reset_prefix_cache", None)
                self._holder = client
            finally:
                self.on_all("/resume", None)
            return time.perf_counter() - tick

    def check_names(
        self, weights: Mapping[str, torch.Tensor], tied: tuple[str, str] | None
    ) -> None:
        """Every tensor a publication sends names a parameter each server has (vLLM's names
        fuse q/k/v and gate/up): a reload that meets an unknown name fails half done and
        leaves the server's model broken, so it is refused here first. A tied policy needs
        servers that serve its head as a tensor of its own (:func:`tied_head`). The names are
        asked once per fleet (a reload never changes them)."""
        if self._served_names is None:
            self._served_names = [set(self.checksums(i)) for i in range(len(self.urls))]
        for i, served in enumerate(self._served_names):
            if not served:  # a server that reports no parameters: nothing to compare
                continue
            unknown = sorted(n for n in weights if vllm_name(n) not in served)
            if tied is not None and tied[1] in unknown:
                raise InputError(
                    f"rollout.urls[{i}]: {self.urls[i]} serves the policy's output head tied to "
                    "its embedding, which vLLM's CPU reload leaves stale; start the server with "
                    "`python -m furlong.rollout.vllm_server MODEL` (it serves an untied copy)"
                )
            if unknown:
                raise InputError(
                    f"rollout.urls[{i}]: {self.urls[i]} serves no parameters named {unknown[:5]} "
                    f"({len(unknown)} in all): a different model"
                )

    def checksums(self, server: int) -> dict[str, str]:
        """vLLM's sha256 of each parameter of one server, by vLLM's parameter name."""
        got = self.post(server, "/weight_checker", {"action": "checksum"}, "check_served")
        return {k.split(":")[-1]: v for k, v in got["checksums"].items()}

    def check_served(self, weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        served = self.checksums(0)
        empty = hashlib.sha256(b"").hexdigest()
        compared = sorted(n for n, d in served.items() if d != empty and n in weights)
        mismatched = [n for n in compared if _digest(weights[n]) != served[n]]
        return {"compared": len(compared), "mismatched": mismatched, "served": len(served)}

    def discard(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def release(self, client: VLLMClient) -> None:
        with self._shared_lock, self._cond:
            if self._holder is client:
                self._holder = None
            self._users -= 1
            if self._users > 0:
                return
            self._shared.pop(self._key, None)
        for http in self._http:
            http.close()
        for server in self._servers:
            server.stop()
        atexit.unregister(self._remove_staging)
        self._remove_staging()

    def _remove_staging(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


# ---------------------------------------------------------------- helpers


_FUSED = {  # vLLM's stacked parameters (its Llama/Qwen load_weights mapping)
    ".q_proj.": ".qkv_proj.",
    ".k_proj.": ".qkv_proj.",
    ".v_proj.": ".qkv_proj.",
    ".gate_proj.": ".gate_up_proj.",
    ".up_proj.": ".gate_up_proj.",
}


def vllm_name(name: str) -> str:
    """The vLLM parameter a checkpoint tensor loads into."""
    for ours, theirs in _FUSED.items():
        if ours in name:
            return name.replace(ours, theirs)
    return name


def _eos_ids(policy: Any) -> list[int]:
    eos = policy.generation_config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def _refuse_moe(policy: Any) -> None:
    from furlong.models.moe import find_routers

    if find_routers(policy):
        raise InputError(
            'rollout.engine: "vllm" serves dense models here; MoE routes for routing replay '
            '(R3) come from the embedded engine (rollout.engine = "embedded")'
        )


def _staging(staging_dir: str | os.PathLike | None, urls: list[str]) -> Path:
    """A directory of this fleet's own under ``staging_dir`` (default: ``/dev/shm``, memory,
    for servers on this host), named by this process's id. Under the default root, the
    directories of processes that died without removing theirs (a kill -9) are removed first:
    each held a model's weights in memory."""
    if staging_dir:
        root = Path(staging_dir)
    else:
        remote = [u for u in urls if httpx.URL(u).host not in ("127.0.0.1", "localhost", "::1")]
        if remote:
            raise InputError(
                f"rollout.staging_dir: {remote[0]} is not on this host; give a directory both "
                "this process and the servers can read (published weights go through it)"
            )
        root = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"rollout.staging_dir: cannot create {root} ({e.strerror})") from None
    for old in [] if staging_dir else root.glob(f"{STAGING_PREFIX}*"):  # local roots only: a
        pid = old.name.removeprefix(STAGING_PREFIX).partition("-")[0]  # shared one spans hosts
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=root))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _served_context(urls: list[str], timeout: float) -> list[int]:
    lengths = []
    for i, url in enumerate(urls):
        try:
            models = httpx.get(f"{url}/v1/models", timeout=timeout).json()["data"]
            lengths.append(int(models[0]["max_model_len"]))
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            raise InputError(
                f"rollout.urls[{i}]: {url} does not answer /v1/models as vLLM ({e})"
            ) from e
    return lengths


def _digest(tensor: torch.Tensor) -> str:
    """vLLM's checksum of one tensor (``weight_checksum.compute_tensor_digests``)."""
    data = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.data).hexdigest()


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        error = body.get("error") or body.get("detail")
        if isinstance(error, dict):
            return str(error.get("message", error))
        if error is not None:
            return str(error)
    return response.text[:500]


if TYPE_CHECKING:

    def _rollout(engine: VLLMClient) -> RolloutEngine:
        return engine

    def _session(engine: VLLMClient) -> SessionEngine:
        return engine

    def _sampling(engine: VLLMClient) -> SamplingEngine:
        return engine
