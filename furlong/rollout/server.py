"""``furlong rollout-server``: the embedded engine behind SGLang's native HTTP protocol.

Endpoints (SGLang's names and bodies): ``POST /generate``, ``GET /health``,
``GET /health_generate``, ``GET /get_model_info``, ``GET /get_weight_version``,
``GET /get_server_info``, ``POST /update_weights_from_disk``, ``POST /pause_generation``,
``POST /continue_generation``, ``POST /release_memory_occupation``,
``POST /resume_memory_occupation``, ``POST /flush_cache``, ``POST /abort_request``; and
furlong's ``POST /furlong/update_weights_bucket`` (bucketed weights as safetensors bytes).
Concurrent ``/generate`` calls join one running batch. Bad requests get HTTP 400 with
``{"error": {"message": ...}}`` naming the field (SGLang's error shape), and nothing is queued;
bodies over ``max_body_bytes`` (a weight bucket: ``max_bucket_bytes``) get 413.

Generation and the read-only routes are open; the control routes (:data:`CONTROL_ROUTES`) ask
for the :class:`~furlong.rollout.control.ControlPolicy`'s admin token when it has one (401
otherwise, checked before the body is read), and ``/update_weights_from_disk`` loads only
what the policy allows.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from safetensors.torch import load as safetensors_load
from starlette.exceptions import HTTPException as StarletteHTTPException

from furlong.errors import InputError
from furlong.listen import bind
from furlong.rollout import sglang_wire as wire
from furlong.rollout.base import MEMORY_TAGS, MemoryTag, check_tags
from furlong.rollout.control import ControlPolicy, Unauthorized
from furlong.rollout.engine import EmbeddedEngine
from furlong.serving import read_json_object

# Bodies past this are refused (413) as they arrive: a /generate batch of 1,000 prompts of
# 4,096 ids is about 25 MB of JSON. A weight bucket holds whole tensors (a 150k x 8192 bf16
# embedding alone is 2.4 GB), so that route has its own, larger limit.
MAX_BODY_BYTES = 64 << 20
MAX_BUCKET_BYTES = 4 << 30
_ANY_SIZE = 1 << 50

BUCKET_ROUTE = "/furlong/update_weights_bucket"
# who may change what the server serves: the trainer, with the admin token
CONTROL_ROUTES = (
    "/update_weights_from_disk",
    BUCKET_ROUTE,
    "/pause_generation",
    "/continue_generation",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/flush_cache",
    "/abort_request",
)


class _TooLarge(Exception):
    """HTTP 413 for a body past a route's own limit."""


def _error(message: str, status: int = 400, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status, headers=headers)


def create_app(
    engine: EmbeddedEngine,
    model_path: str = "",
    max_body_bytes: int = MAX_BODY_BYTES,
    policy: ControlPolicy | None = None,
    max_bucket_bytes: int = MAX_BUCKET_BYTES,
) -> FastAPI:
    """The server's app. ``policy``: who may call the control routes and which weight files
    they may name; the default is open (an in-process server, trusted callers)."""
    policy = ControlPolicy() if policy is None else policy
    app = FastAPI(title="furlong rollout server (SGLang protocol)", max_body_size=max_body_bytes)

    async def admin_only(request: Request) -> None:
        policy.require_admin(request.headers)  # headers only: the body is not read yet

    control = APIRouter(dependencies=[Depends(admin_only)])

    @app.exception_handler(InputError)
    async def _bad_input(_request: Request, exc: InputError) -> JSONResponse:
        return _error(str(exc))

    @app.exception_handler(Unauthorized)
    async def _unauthorized(_request: Request, exc: Unauthorized) -> JSONResponse:
        return _error(str(exc), 401, {"WWW-Authenticate": "Bearer"})

    @app.exception_handler(_TooLarge)
    async def _too_large(_request: Request, exc: _TooLarge) -> JSONResponse:
        return _error(str(exc), 413)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 413:
            return _error(f"body: over the server's limit of {max_body_bytes} bytes", 413)
        return _error(str(exc.detail), exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _bad_schema(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(f"request: {exc.errors()}")

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Any:
        body = await read_json_object(request)
        batch, prompts, params, rids = _parse_generate(engine, body)
        start = time.perf_counter()
        futures = engine.submit_many(prompts, params, rids)  # validates all, then queues
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        latency = time.perf_counter() - start
        start_len = int(body.get("logprob_start_len", -1))
        out = [
            wire.response_body(
                r,
                engine.tokenizer.decode(r.output_ids),
                engine.stop_ids(p),
                start_len,
                latency,
            )
            for r, p in zip(results, params, strict=True)
        ]
        return out if batch else out[0]

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.get("/get_model_info")
    async def model_info() -> dict:
        top_k = getattr(engine.model.config, "num_experts_per_tok", None)
        shape = [len(engine.router.routers), top_k] if engine.router.is_moe else None
        return {
            "model_path": model_path,
            "tokenizer_path": model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(engine.weight_version),
            "furlong": {
                "vocab_size": engine.vocab_size,
                "eos_token_ids": sorted(engine.eos_ids),
                "routed_experts_shape": shape,
                # names and shapes, so that a publisher can check before it pauses generation
                "parameters": {n: list(v) for n, v in engine.weight_shapes().items()},
            },
        }

    @app.get("/get_weight_version")
    async def weight_version() -> dict:
        return {"weight_version": str(engine.weight_version)}

    @app.get("/get_server_info")
    async def server_info() -> dict:
        return {
            "model_path": model_path,
            "max_running_requests": engine.max_running,
            "paused": engine.paused,
            "offloaded": sorted(engine.offloaded),
            "weight_version": str(engine.weight_version),
        }

    @control.post("/update_weights_from_disk")
    async def update_from_disk(request: Request) -> JSONResponse:
        try:  # SGLang's reply shape, also for refusals
            path, version, abort_all = _disk_update(await read_json_object(request))
            # any failure to load is one message: the client learns nothing about the file
            tensors = await run_in_threadpool(policy.load_weights, path, "model_path")
            if abort_all:
                engine.check_weights(tensors)  # a refused publication aborts nothing
                await run_in_threadpool(engine.abort)
            new = await run_in_threadpool(engine.update_weights, tensors, version)
        except InputError as e:
            return JSONResponse(
                {"success": False, "message": str(e), "num_paused_requests": 0}, 400
            )
        return JSONResponse(
            {
                "success": True,
                "message": f"Succeeded to update model weights. Weight version {new}.",
                "num_paused_requests": 0,
            }
        )

    @control.post(BUCKET_ROUTE, max_body_size=_ANY_SIZE)  # capped below, with its own message
    async def update_bucket(
        request: Request, final: bool = True, weight_version: int | None = None
    ) -> dict:
        """furlong's bucketed publication across processes (SGLang's own tensor endpoint
        carries CUDA-IPC handles): the body is one safetensors blob; ``final=false`` buckets
        are copied without moving the weight version."""
        blob = await _read_capped(request, max_bucket_bytes)
        try:
            bucket = safetensors_load(blob)
        except Exception as e:  # safetensors raises its own error types on bad bytes
            raise InputError(f"body: not a safetensors payload ({e})") from e
        new = await run_in_threadpool(
            functools.partial(engine.update_weights, bucket, weight_version, final=final)
        )
        return {"success": True, "weight_version": str(new)}

    @control.post("/pause_generation")
    async def pause(request: Request) -> dict:
        body = await read_json_object(request, required=False)
        await run_in_threadpool(engine.pause, body.get("mode", "abort"))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @control.post("/continue_generation")
    async def resume(request: Request) -> dict:
        await read_json_object(request, required=False)
        engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @control.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release(request: Request) -> None:
        tags = _tags(await read_json_object(request, required=False))
        if tags:
            await run_in_threadpool(engine.offload, tags)

    @control.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory(request: Request) -> None:
        tags = _tags(await read_json_object(request, required=False))
        if tags:
            await run_in_threadpool(engine.onload, tags)

    @control.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        # No prefix cache to flush; like SGLang, refuse while requests are in the engine.
        if engine.busy:
            return PlainTextResponse("Cache not flushed: requests are running.", 400)
        return PlainTextResponse("Cache flushed.")

    @control.post("/abort_request")
    async def abort(request: Request) -> PlainTextResponse:
        body = await read_json_object(request)
        if body.get("abort_all"):
            await run_in_threadpool(engine.abort)
        elif body.get("rid"):
            await run_in_threadpool(engine.abort, [str(body["rid"])])
        return PlainTextResponse("")

    app.include_router(control)  # after its routes are declared
    return app


def _disk_update(body: dict) -> tuple[str, int | None, bool]:
    """(model_path, weight_version, abort_all_requests) of an ``/update_weights_from_disk``
    body, checked before anything is loaded."""
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise InputError("model_path: expected a non-empty string")
    raw_version = body.get("weight_version")
    version = None if raw_version is None else wire.parse_version(raw_version)
    if raw_version is not None and version is None:
        raise InputError(f"weight_version: furlong versions are integers, got {raw_version!r}")
    return path, version, wire.flag(body.get("abort_all_requests"), "abort_all_requests")


async def _read_capped(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to pass ``limit``: by its declared
    length before any of it is read, else as the chunks arrive."""
    too_large = _TooLarge(f"body: over the server's weight bucket limit of {limit} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_generate(engine: EmbeddedEngine, body: dict) -> tuple[bool, list, list, list]:
    """(is_batch, prompts, params, request ids) from a ``/generate`` body, all validated."""
    if wire.flag(body.get("stream"), "stream"):
        raise InputError("stream: streaming is not supported by furlong's rollout server")
    body["logprob_start_len"] = wire.integer(body.get("logprob_start_len"), "logprob_start_len", -1)
    batch, prompts = _prompts(engine, body.get("input_ids"), body.get("text"))
    n = len(prompts)
    sps = body.get("sampling_params")
    if isinstance(sps, list):
        if len(sps) != n:
            raise InputError(f"sampling_params: {len(sps)} for {n} prompts")
    else:
        sps = [sps] * n
    if body["logprob_start_len"] >= 0 and body.get("return_logprob"):
        for i, p in enumerate(prompts):
            if body["logprob_start_len"] >= len(p):
                raise InputError(
                    f"logprob_start_len: {body['logprob_start_len']} >= prompt length "
                    f"{len(p)} of input_ids[{i}]"
                )
    where = (lambda i: f"sampling_params[{i}]") if batch else (lambda i: "sampling_params")
    params = [wire.sampling_params(sp, body, engine.eos_ids, where(i)) for i, sp in enumerate(sps)]
    return batch, prompts, params, _request_ids(body.get("rid"), n, batch)


def _prompts(engine: EmbeddedEngine, ids: Any, text: Any) -> tuple[bool, list[list[int]]]:
    """(is_batch, prompt token ids) from ``input_ids`` or ``text``: one prompt or a list."""
    if (ids is None) == (text is None):
        raise InputError("input_ids / text: give exactly one of them")
    if text is not None:
        batch = isinstance(text, list)
        texts = text if batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise InputError("text: expected a string or a non-empty list of strings")
        prompts = [engine.tokenizer(t)["input_ids"] for t in texts]
        for i, p in enumerate(prompts):
            if not p:
                raise InputError(f"{f'text[{i}]' if batch else 'text'}: no tokens")
        return batch, prompts
    if not isinstance(ids, list) or not ids:
        raise InputError("input_ids: expected a non-empty list")
    batch = isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    for i, p in enumerate(prompts):
        name = f"input_ids[{i}]" if batch else "input_ids"
        if not isinstance(p, list) or not p:
            raise InputError(f"{name}: expected a non-empty list of integers")
        for j, t in enumerate(p):
            if isinstance(t, bool) or not isinstance(t, int):
                raise InputError(f"{name}[{j}]: expected an integer, got {t!r}")
            if not 0 <= t < engine.vocab_size:
                raise InputError(f"{name}[{j}]: token id {t} outside [0, {engine.vocab_size})")
    return batch, prompts


def _request_ids(rid: Any, n: int, batch: bool) -> list[str]:
    """SGLang's ``rid``: one string (a batch gets ``{rid}_{i}``), one per prompt, or none."""
    if rid is None:
        base = uuid.uuid4().hex
        return [f"{base}_{i}" for i in range(n)] if batch else [base]
    if isinstance(rid, list):
        if len(rid) != n:
            raise InputError(f"rid: {len(rid)} for {n} prompts")
        for i, r in enumerate(rid):
            if isinstance(r, bool) or not isinstance(r, str | int):
                raise InputError(f"rid[{i}]: expected a string, got {r!r}")
        return [str(r) for r in rid]
    if isinstance(rid, bool) or not isinstance(rid, str | int):
        raise InputError(f"rid: expected a string or a list of strings, got {rid!r}")
    return [f"{rid}_{i}" for i in range(n)] if batch else [str(rid)]


def _tags(body: dict) -> list[MemoryTag]:
    """SGLang's tags; ``null`` means all. ``cuda_graph`` has nothing to release here."""
    tags = body.get("tags")
    if not tags:  # null or []
        return list(MEMORY_TAGS)
    if not isinstance(tags, list):
        raise InputError("tags: expected a list of strings or null")
    kept = [t for t in tags if t != "cuda_graph"]
    return check_tags(kept) if kept else []


def serve(
    model: str,
    host: str,
    port: int,
    max_running: int,
    seed: int,
    policy: ControlPolicy,
    max_bucket_bytes: int = MAX_BUCKET_BYTES,
    sock: socket.socket | None = None,
) -> None:
    """``sock``: the listening socket for ``host``:``port`` (``furlong.listen.bind``; else it
    is opened here, before the model loads)."""
    from furlong.models import load_model
    from furlong.models.names import check_model
    from furlong.serving import run_announced

    check_model(model, "--model")
    sock = bind(host, port) if sock is None else sock
    net, tokenizer = load_model(model, seed=seed)
    engine = EmbeddedEngine(net, tokenizer, max_running=max_running)
    app = create_app(engine, model, policy=policy, max_bucket_bytes=max_bucket_bytes)
    run_announced(
        app,
        host,
        port,
        lambda url: f"furlong rollout-server: {model} on {url} (SGLang HTTP protocol)",
        sock,
    )
