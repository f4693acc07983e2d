"""A :class:`~furlong.rollout.base.RolloutEngine` over SGLang's HTTP protocol, on one server or
a fleet of them.

Points at ``furlong rollout-server`` or at real SGLang servers (``python -m
sglang.launch_server ... --enable-return-routed-experts --enable-memory-saver``); switching is
a URL change. Each prompt is its own ``/generate`` call, sent concurrently so the servers
batch them continuously; with several URLs each request goes to the server with the fewest
requests in flight (ties in turn), and weights, pausing and memory calls go to every server.
``update_weights`` takes a safetensors file or an HF directory the servers can read
(``/update_weights_from_disk``), or a state dict: written to ``staging_dir`` (a filesystem
shared with the servers; works with SGLang) or, without one, sent in buckets of
``bucket_bytes`` over HTTP (furlong's server only). ``admin_token`` is sent with every request
(``Authorization: Bearer``): ``furlong rollout-server`` asks for it on its control routes.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
from safetensors.torch import save, save_file

from furlong.errors import InputError
from furlong.models.moe import find_routers
from furlong.rollout import sglang_wire as wire
from furlong.rollout.base import (
    GenerateResult,
    MemoryBytes,
    MemoryTag,
    PauseMode,
    RolloutEngine,
    SessionEngine,
    Weights,
    check_pause_mode,
    check_tags,
    check_url,
    check_weight_shapes,
    expand_params,
    no_memory,
)
from furlong.rollout.control import ADMIN_TOKEN_ENV, Unauthorized
from furlong.rollout.registry import EngineRequest
from furlong.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel

T = TypeVar("T")


@dataclass(frozen=True)
class RemoteRouter:
    """The served model's MoE routing as the client knows it: ``shape`` = (router layers,
    top_k) of the routed-expert rows, None for a dense model."""

    shape: tuple[int, int] | None = None

    @property
    def is_moe(self) -> bool:
        return self.shape is not None


class SGLangClient:
    # the served model's, given by the caller (the HTTP protocol does not carry them)
    tokenizer: Any
    context_length: int | None

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        tokenizer: Any = None,
        context_length: int | None = None,
        timeout: float = 600.0,
        max_concurrency: int = 64,
        routed_experts_shape: tuple[int, int] | None = None,
        staging_dir: str | os.PathLike | None = None,
        bucket_bytes: int = 64 << 20,
        admin_token: str | None = None,
    ):
        """``urls``: one base URL or several (servers of the same model). ``tokenizer`` and
        ``context_length`` are the served model's, for the session server (the HTTP protocol
        does not carry them). ``routed_experts_shape``: (layers, top_k) of an MoE model; None
        asks furlong's server, and a server that does not say is taken as dense.
        ``max_concurrency``: requests in flight per server. ``admin_token``: the servers' token
        for weight publication, pausing, memory and aborts (``furlong rollout-server
        --admin-token-file`` / ``$FURLONG_ADMIN_TOKEN``)."""
        listed = [urls] if isinstance(urls, str) else list(urls)
        if not listed:
            raise InputError("urls: empty; expected at least one server URL")
        self.urls = [check_url(u, f"urls[{i}]") for i, u in enumerate(listed)]
        self.tokenizer = tokenizer
        self.context_length = context_length
        auth = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._servers = [httpx.Client(base_url=u, timeout=timeout, headers=auth) for u in self.urls]
        self._pool = ThreadPoolExecutor(
            max_concurrency * len(self.urls), thread_name_prefix="sglang-client"
        )
        shape = routed_experts_shape
        self._router = None if shape is None else RemoteRouter((int(shape[0]), int(shape[1])))
        self._staging = Path(staging_dir) if staging_dir else None
        self._bucket_bytes = bucket_bytes
        self._shapes: dict[str, list[int]] | None = None  # the served parameters, once asked
        self._lock = threading.Lock()  # guards the placement state below
        self._in_flight = [0] * len(self.urls)
        self._turn = 0  # the next server to win a tie
        self._placed: dict[str, int] = {}  # request id -> its server, while in flight

    @classmethod
    def from_request(cls, request: EngineRequest) -> SGLangClient:
        """The registry's ``sglang`` kind: one client over the servers at
        ``request.options["urls"]``, each checked to serve a model ``request.model``'s weights fit,
        then sent those weights as version 0 (the servers may hold others). Options:
        ``urls``, ``staging_dir`` (a directory the servers read published weights from;
        required by real SGLang), ``timeout``. The admin token is ``$FURLONG_ADMIN_TOKEN``."""
        options, policy = request.options, request.model
        urls = [check_url(u, f"rollout.urls[{i}]") for i, u in enumerate(options.get("urls", ()))]
        if not urls:
            raise InputError('rollout.urls: rollout.engine = "sglang" needs at least one URL')
        staging_dir = options.get("staging_dir") or None
        client = cls(
            urls,
            tokenizer=request.tokenizer,
            context_length=getattr(policy.config, "max_position_embeddings", None),
            routed_experts_shape=routed_experts_shape(policy),
            staging_dir=staging_dir,
            timeout=float(options.get("timeout", 600.0)),
            admin_token=os.environ.get(ADMIN_TOKEN_ENV, "").strip() or None,
            max_concurrency=max(1, math.ceil(request.max_running / len(urls))),
        )
        try:
            for i in range(len(urls)):
                client._check_serves(i, policy, staging_dir)
            weights = {name: p.detach() for name, p in policy.named_parameters()}
            client.update_weights(weights, version=0)
        except BaseException:
            client.close()
            raise
        return client

    def _check_serves(
        self, i: int, policy: PreTrainedModel, staging_dir: str | os.PathLike | None
    ) -> None:
        """Server ``i`` answers and serves a model the policy's weights fit, as far as it says."""
        field, url = f"rollout.urls[{i}]", self.urls[i]
        try:
            info = self.model_info(i)
        except (httpx.HTTPError, ValueError) as e:
            raise InputError(f"{field}: {url} does not answer /get_model_info ({e})") from e
        ours = info.get("furlong") if isinstance(info, dict) else None
        if ours is None:  # real SGLang: says nothing to compare, and loads weights from disk only
            if not staging_dir:
                raise InputError(
                    f"rollout.staging_dir: {url} is an SGLang server, which loads published "
                    "weights from disk; give a directory it can read"
                )
            return
        vocab = int(policy.get_output_embeddings().out_features)
        if ours.get("vocab_size") != vocab:
            raise InputError(
                f"{field}: {url} serves a vocabulary of {ours.get('vocab_size')} ids, "
                f"the policy has {vocab}"
            )
        shape = ours.get("routed_experts_shape")
        theirs, policy_shape = (tuple(shape) if shape else None), routed_experts_shape(policy)
        if theirs != policy_shape:
            raise InputError(
                f"{field}: {url} serves routed experts of shape {theirs}, the policy's are "
                f"{policy_shape} (a different model)"
            )

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for server in self._servers:
            server.close()

    def __enter__(self) -> SGLangClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- the served model

    def model_info(self, server: int = 0) -> dict[str, Any]:
        """``/get_model_info`` of one server (furlong's adds a ``furlong`` block)."""
        return self._get(server, "/get_model_info")

    @property
    def router(self) -> RemoteRouter:
        if self._router is None:  # asked once: every server serves the same model
            shape = (self.model_info().get("furlong") or {}).get("routed_experts_shape")
            self._router = RemoteRouter((int(shape[0]), int(shape[1])) if shape else None)
        return self._router

    # ---------------------------------------------------------------- generation

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerateResult]:
        plist = expand_params(len(prompts), params)
        # every request is checked before any is sent
        checked = [self._check_request(i, prompts[i], plist[i]) for i in range(len(plist))]
        jobs = [self._send(i, checked[i], plist[i], None) for i in range(len(plist))]
        return [job.result() for job in jobs]

    def submit(
        self, prompt: Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> Future[GenerateResult]:
        """One request, checked here (a bad one raises before anything is sent); with a
        ``request_id``, :meth:`abort` reaches it on its server."""
        return self._send(0, self._check_request(0, prompt, params), params, request_id)

    def _check_request(self, index: int, prompt: Sequence[int], params: SamplingParams) -> list:
        """What can be checked without the server; the server checks the rest (400)."""
        if not isinstance(params, SamplingParams):
            raise InputError(f"params[{index}]: expected SamplingParams, got {type(params)}")
        if not prompt:
            raise InputError(f"prompts[{index}]: empty")
        if params.return_routed_experts and not self.router.is_moe:
            raise InputError(
                f"params[{index}].return_routed_experts: the server reports no MoE routing "
                "shape; pass routed_experts_shape=(layers, top_k) to SGLangClient"
            )
        context = self.context_length
        if context is not None and len(prompt) + params.max_tokens > context:
            raise InputError(
                f"params[{index}].max_tokens: {len(prompt)} prompt tokens + max_tokens "
                f"{params.max_tokens} exceed the model's context of {context}"
            )
        return [int(t) for t in prompt]

    def _send(
        self, index: int, prompt: list[int], params: SamplingParams, request_id: str | None
    ) -> Future[GenerateResult]:
        server = self._place(request_id)
        try:
            job = self._pool.submit(self._generate_one, server, index, prompt, params, request_id)
        except BaseException:
            self._release(server, request_id)
            raise
        job.add_done_callback(lambda _: self._release(server, request_id))
        return job

    def _generate_one(
        self,
        server: int,
        index: int,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None,
    ) -> GenerateResult:
        body = wire.request_body(prompt, params, request_id)
        reply = self._post(server, "/generate", body, where=f"prompts[{index}]")
        shape = self.router.shape if params.return_routed_experts else None
        return wire.generate_result(reply, prompt, params, shape)

    def _place(self, request_id: str | None) -> int:
        """The server with the fewest requests in flight; ties go round in turn."""
        n = len(self._servers)
        with self._lock:
            server = min(range(n), key=lambda j: (self._in_flight[j], (j - self._turn) % n))
            self._turn = (server + 1) % n
            self._in_flight[server] += 1
            if request_id is not None:
                self._placed[str(request_id)] = server
        return server

    def _release(self, server: int, request_id: str | None) -> None:
        with self._lock:
            self._in_flight[server] -= 1
            if request_id is not None and self._placed.get(str(request_id)) == server:
                del self._placed[str(request_id)]

    # ---------------------------------------------------------------- weights

    @property
    def weight_version(self) -> int:
        """The lowest version across the servers (they agree after every publication)."""
        versions = self._on_all(self._version_of)
        return min(versions)

    def _version_of(self, server: int) -> int:
        raw = self._get(server, "/get_weight_version")["weight_version"]
        return wire.parse_version(raw) or 0

    def check_weights(self, weights: Mapping[str, Any]) -> None:
        """Names and shapes against what furlong's rollout server reports; a server that does
        not report them (SGLang's own) checks only when the weights arrive."""
        if self._shapes is None:  # asked once: every server serves the same model
            self._shapes = (self.model_info().get("furlong") or {}).get("parameters") or {}
        if self._shapes:
            check_weight_shapes(weights, self._shapes)

    def update_weights(self, weights: Weights, version: int | None = None) -> int:
        """Publish to every server; returns the version they all report."""
        if isinstance(weights, Mapping):
            return self._update_from_tensors(weights, version)
        body: dict[str, Any] = {"model_path": str(Path(weights).resolve())}
        if version is not None:
            body["weight_version"] = str(version)
        self._on_all(lambda i: self._post(i, "/update_weights_from_disk", body, "update_weights"))
        return self._agreed(self._on_all(self._version_of))

    def _update_from_tensors(self, weights: Mapping[str, Any], version: int | None) -> int:
        if self._staging is None:
            return self._update_in_buckets(weights, version)
        self._staging.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self._staging) as tmp:
            # written once, read by every server; SGLang's loader takes a directory
            tensors = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
            save_file(tensors, str(Path(tmp) / "model.safetensors"))
            return self.update_weights(tmp, version)

    def _update_in_buckets(self, weights: Mapping[str, Any], version: int | None) -> int:
        """Each bucket is serialized once and sent to every server before the next."""
        buckets = list(_buckets(weights, self._bucket_bytes))
        versions: list[int] = []
        for i, bucket in enumerate(buckets):
            blob = save(bucket)
            query: dict[str, Any] = {"final": str(i == len(buckets) - 1).lower()}
            if version is not None:
                query["weight_version"] = version

            def push(server: int, blob: bytes = blob, query: dict = query) -> int:
                path = "/furlong/update_weights_bucket"
                response = self._servers[server].post(path, content=blob, params=query)
                return int(self._check(response, "update_weights")["weight_version"])

            versions = self._on_all(push)
        return self._agreed(versions)

    def _agreed(self, versions: list[int]) -> int:
        if len(set(versions)) > 1:  # a partial publication: the fleet must not sample on
            seen = dict(zip(self.urls, versions, strict=True))
            raise RuntimeError(f"update_weights: the servers disagree on the version: {seen}")
        return versions[0]

    # ---------------------------------------------------------------- control

    def abort(self, request_ids: Iterable[int | str] | None = None) -> int:
        """Abort by id on the server the request went to (every server when unknown)."""
        if request_ids is None:
            self._on_all(lambda i: self._post(i, "/abort_request", {"abort_all": True}, "abort"))
            return -1  # the servers do not say how many
        ids = [str(rid) for rid in request_ids]
        for rid in ids:
            with self._lock:
                known = self._placed.get(rid)
            for server in range(len(self._servers)) if known is None else [known]:
                self._post(server, "/abort_request", {"rid": rid}, "abort")
        return len(ids)

    def pause(self, mode: PauseMode = "retract") -> None:
        body = {"mode": check_pause_mode(mode)}
        self._on_all(lambda i: self._post(i, "/pause_generation", body, "pause"))

    def resume(self) -> None:
        self._on_all(lambda i: self._post(i, "/continue_generation", {}, "resume"))

    def offload(self, tags: Iterable[MemoryTag]) -> None:
        body = {"tags": check_tags(tags)}
        self._on_all(lambda i: self._post(i, "/release_memory_occupation", body, "offload"))

    def onload(self, tags: Iterable[MemoryTag]) -> None:
        body = {"tags": check_tags(tags)}
        self._on_all(lambda i: self._post(i, "/resume_memory_occupation", body, "onload"))

    def memory_bytes(self) -> MemoryBytes:
        return no_memory()  # the servers' memory is theirs: the ledger records events only

    def metrics(self) -> dict[str, float]:
        return {}

    def health(self) -> bool:
        """Every server answers ``/health``."""
        try:
            return all(s.get("/health").status_code == 200 for s in self._servers)
        except httpx.HTTPError:
            return False

    # ---------------------------------------------------------------- transport

    def _on_all(self, call: Callable[[int], T]) -> list[T]:
        """``call(server)`` for every server at once (not on the request pool: a pause must
        not queue behind the generation it pauses); the first error is raised."""
        n = len(self._servers)
        if n == 1:
            return [call(0)]
        with ThreadPoolExecutor(n, thread_name_prefix="sglang-fleet") as fleet:
            return list(fleet.map(call, range(n)))

    def _get(self, server: int, path: str) -> Any:
        response = self._servers[server].get(path)
        _check_auth(response, path)
        response.raise_for_status()
        return response.json()

    def _post(self, server: int, path: str, body: dict, where: str) -> Any:
        return self._check(self._servers[server].post(path, json=body), where)

    def _check(self, response: httpx.Response, where: str) -> Any:
        url = response.request.url
        _check_auth(response, where)
        if response.status_code == 400:  # the server names the bad field
            raise InputError(f"{where}: {_message(response)}")
        if response.status_code != 200:
            raise RuntimeError(f"{where}: {url} returned {response.status_code}: {response.text}")
        return response.json() if response.content else None


def _buckets(weights: Mapping[str, Any], limit: int) -> Iterator[dict[str, Any]]:
    """Whole tensors in groups of at most ``limit`` bytes (a larger tensor goes alone); at
    least one group, so the final bucket always moves the version."""
    bucket: dict[str, Any] = {}
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor.detach().contiguous().cpu()
        size += nbytes
    yield bucket


def _check_auth(response: httpx.Response, where: str) -> None:
    if response.status_code == 401:
        raise Unauthorized(
            f"{where}: {response.request.url} refused the call (401): the admin token is "
            "missing or wrong; pass SGLangClient(..., admin_token=...) with the server's token"
        )


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
    return response.text


def routed_experts_shape(policy: PreTrainedModel) -> tuple[int, int] | None:
    """(router layers, top_k) of an MoE policy's routed-expert rows; None when dense."""
    routers = find_routers(policy)
    if not routers:
        return None
    return len(routers), int(policy.config.num_experts_per_tok)


if TYPE_CHECKING:
    # mypy holds the kind to each protocol it serves, signatures included (the registry's
    # run-time check reads only the names); one function per protocol, so that an error names
    # the missing or mismatched member

    def _rollout(engine: SGLangClient) -> RolloutEngine:
        return engine

    def _session(engine: SGLangClient) -> SessionEngine:
        return engine
