"""``furlong rollout-server``: the embedded engine behind SGLang's native HTTP protocol.

Endpoints (SGLang's names and bodies): ``POST /generate``, ``GET /health``,
``GET /health_generate``, ``GET /get_model_info``, ``GET /get_weight_version``,
``GET /get_server_info``, ``POST /update_weights_from_disk``, ``POST /pause_generation``,
``POST /continue_generation``, ``POST /release_memory_occupation``,
``POST /resume_memory_occupation``, ``POST /flush_cache``, ``POST /abort_request``; and
furlong's ``POST /furlong/update_weights_bucket`` (bucketed weights as safetensors bytes).
Concurrent ``/generate`` calls join one running batch. Bad requests get HTTP 400 with
``{"error": {"message": ...}}`` naming the field (SGLang's error shape), and nothing is queued;
bodies over ``max_body_bytes`` get 413.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from starlette.exceptions import HTTPException as StarletteHTTPException

from furlong.errors import InputError
from furlong.rollout import sglang_wire as wire
from furlong.rollout.base import MEMORY_TAGS, check_tags
from furlong.rollout.engine import EmbeddedEngine
from furlong.serving import read_json_object

# Bodies past this are refused (413) as they arrive: a /generate batch of 1,000 prompts of
# 4,096 ids is about 25 MB of JSON. A weight bucket holds whole tensors (an embedding alone
# can be GBs), so that route takes any size.
MAX_BODY_BYTES = 64 << 20
_ANY_SIZE = 1 << 50


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def create_app(
    engine: EmbeddedEngine, model_path: str = "", max_body_bytes: int = MAX_BODY_BYTES
) -> FastAPI:
    app = FastAPI(title="furlong rollout server (SGLang protocol)", max_body_size=max_body_bytes)

    @app.exception_handler(InputError)
    async def _bad_input(_request: Request, exc: InputError) -> JSONResponse:
        return _error(str(exc))

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

    @app.post("/update_weights_from_disk")
    async def update_from_disk(request: Request) -> JSONResponse:
        body = await read_json_object(request)
        path = body.get("model_path")
        raw_version = body.get("weight_version")
        version = None if raw_version is None else wire.parse_version(raw_version)
        failure = None
        if not isinstance(path, str) or not path:
            failure = "model_path: expected a non-empty string"
        elif raw_version is not None and version is None:
            failure = f"weight_version: furlong versions are integers, got {raw_version!r}"
        if failure is None:
            try:
                if wire.flag(body.get("abort_all_requests"), "abort_all_requests"):
                    await run_in_threadpool(engine.abort)
                new = await run_in_threadpool(engine.update_weights, path, version)
            except InputError as e:
                failure = str(e)
            except (OSError, SafetensorError) as e:  # unreadable, or not safetensors
                failure = f"model_path: cannot load {path!r} ({e})"
        if failure is not None:
            return JSONResponse(
                {"success": False, "message": failure, "num_paused_requests": 0}, 400
            )
        return JSONResponse(
            {
                "success": True,
                "message": f"Succeeded to update model weights. Weight version {new}.",
                "num_paused_requests": 0,
            }
        )

    @app.post("/furlong/update_weights_bucket", max_body_size=_ANY_SIZE)
    async def update_bucket(
        request: Request, final: bool = True, weight_version: int | None = None
    ):
        """furlong's bucketed publication across processes (SGLang's own tensor endpoint
        carries CUDA-IPC handles): the body is one safetensors blob; ``final=false`` buckets
        are copied without moving the weight version."""
        try:
            bucket = safetensors_load(await request.body())
        except Exception as e:  # safetensors raises its own error types on bad bytes
            raise InputError(f"body: not a safetensors payload ({e})") from e
        new = await run_in_threadpool(
            functools.partial(engine.update_weights, bucket, weight_version, final=final)
        )
        return {"success": True, "weight_version": str(new)}

    @app.post("/pause_generation")
    async def pause(request: Request) -> dict:
        body = await read_json_object(request, required=False)
        await run_in_threadpool(engine.pause, body.get("mode", "abort"))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def resume(request: Request) -> dict:
        await read_json_object(request, required=False)
        engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release(request: Request) -> None:
        tags = _tags(await read_json_object(request, required=False))
        if tags:
            await run_in_threadpool(engine.offload, tags)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory(request: Request) -> None:
        tags = _tags(await read_json_object(request, required=False))
        if tags:
            await run_in_threadpool(engine.onload, tags)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        # No prefix cache to flush; like SGLang, refuse while requests are in the engine.
        if engine.busy:
            return PlainTextResponse("Cache not flushed: requests are running.", 400)
        return PlainTextResponse("Cache flushed.")

    @app.post("/abort_request")
    async def abort(request: Request) -> PlainTextResponse:
        body = await read_json_object(request)
        if body.get("abort_all"):
            await run_in_threadpool(engine.abort)
        elif body.get("rid"):
            await run_in_threadpool(engine.abort, [str(body["rid"])])
        return PlainTextResponse("")

    return app


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


def _tags(body: dict) -> list[str]:
    """SGLang's tags; ``null`` means all. ``cuda_graph`` has nothing to release here."""
    tags = body.get("tags")
    if not tags:  # null or []
        return list(MEMORY_TAGS)
    if not isinstance(tags, list):
        raise InputError("tags: expected a list of strings or null")
    kept = [t for t in tags if t != "cuda_graph"]
    return check_tags(kept) if kept else []


def serve(model: str, host: str, port: int, max_running: int, seed: int) -> None:
    import uvicorn

    from furlong.models import load_model

    net, tokenizer = load_model(model, seed=seed)
    engine = EmbeddedEngine(net, tokenizer, max_running=max_running)
    uvicorn.run(create_app(engine, model), host=host, port=port, log_level="warning")
