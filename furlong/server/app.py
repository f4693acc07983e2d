"""HTTP routes of ``furlong serve`` (Tinker's wire protocol under ``/api/v1``).

Request bodies are parsed with the ``tinker`` SDK's own types (JSON) and its protobuf schema
(``forward_backward``), so the schema cannot drift from the client. Submission errors are
HTTP 400 with a JSON body naming the field (a refused seq-numbered request still consumes its
``seq_id``); a ``seq_id`` resent with a different body is 409; a body over the limit (as sent
or once inflated) is 413; execution errors come back through the future (HTTP 200
``{"error", "category"}``); another tenant's objects are 404; a missing or unknown key is 401.
Bodies are read in chunks up to the limit, and protobuf bodies are decoded off the event
loop, so a heavy body never blocks other requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from email.utils import formatdate
from typing import Any, TypeVar
from urllib.parse import quote

import pydantic
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from tinker import types as tt

from furlong.errors import InputError
from furlong.server import proto
from furlong.server.checkpoint_archive import ARCHIVE_FILE
from furlong.server.external_weights import InvalidDownloadToken
from furlong.server.futures import Failure
from furlong.server.jwt_auth import InvalidToken, looks_like_jwt
from furlong.server.ordering import Conflict
from furlong.server.service import Service, fingerprint
from furlong.server.sessions import NotFound
from furlong.server.state import iso_time, owner_id

log = logging.getLogger("furlong.serve")
T = TypeVar("T", bound=pydantic.BaseModel)
PREFIX = "/api/v1"


class Unauthorized(Exception):
    pass


class TooLarge(Exception):
    pass


def create_app(
    service: Service, api_keys: frozenset[str] | None = None, max_body_bytes: int = 256 << 20
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        reaper = asyncio.create_task(_reap_forever(service))
        try:
            yield
        finally:
            reaper.cancel()

    app = FastAPI(title="furlong (Tinker protocol)", lifespan=lifespan)

    @app.exception_handler(InputError)
    async def _bad_input(_r: Request, exc: InputError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.exception_handler(NotFound)
    async def _not_found(_r: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse({"detail": f"not found: {exc.args[0]}"}, status_code=404)

    @app.exception_handler(Unauthorized)
    async def _unauthorized(_r: Request, exc: Unauthorized) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=401)

    @app.exception_handler(InvalidToken)
    async def _invalid_token(_r: Request, exc: InvalidToken) -> JSONResponse:
        # RFC 6750's marker: the SDK exchanges its key for a new token and replays once
        header = {"WWW-Authenticate": 'Bearer error="invalid_token"'}
        return JSONResponse({"detail": str(exc)}, status_code=401, headers=header)

    @app.exception_handler(Conflict)
    async def _conflict(_r: Request, exc: Conflict) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(TooLarge)
    async def _too_large(_r: Request, exc: TooLarge) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=413)

    def owner(request: Request) -> str:
        """The tenant of a request: its ``X-API-Key``, or in JWT mode also a token that
        ``auth/token`` issued for a key (the SDK sends it in the same header)."""
        key = request.headers.get("x-api-key", "")
        if service.jwt is not None and looks_like_jwt(key):
            return service.jwt.verify(key)
        return key_owner(key)

    def key_owner(key: str) -> str:
        if api_keys is not None:
            if key not in api_keys:
                raise Unauthorized("X-API-Key: unknown key")
        elif not key.startswith("tml-"):
            raise Unauthorized("X-API-Key: expected a tml-... key")
        return owner_id(key)

    async def raw(request: Request) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:  # refuse before reading it
            raise TooLarge(f"body: {declared} bytes; the limit is {max_body_bytes}")
        body = bytearray()
        async for chunk in request.stream():  # a chunked body has no length to check first
            body += chunk
            if len(body) > max_body_bytes:
                raise TooLarge(
                    f"body: more than {max_body_bytes} bytes; the limit is {max_body_bytes}"
                )
        return bytes(body)

    async def parse(request: Request, cls: type[T]) -> T:
        return _validate(cls, await raw(request))

    async def parse_seq_op(request: Request, who: str, cls: type[T]) -> tuple[T, bytes]:
        """A seq-numbered request and its fingerprint; a body that fails validation still
        consumes the ``seq_id`` it names."""
        body = await raw(request)
        digest = fingerprint(body)
        try:
            return _validate(cls, body), digest
        except InputError as exc:
            service.training.refuse(who, _loose_fields(body), exc, digest)
            raise

    def route(method: str, path: str) -> Callable:
        return app.api_route(PREFIX + path, methods=[method])

    # ------------------------------------------------------------ handshake and sessions

    @route("POST", "/client/config")
    async def client_config(request: Request) -> dict:
        owner(request)
        return {
            "pjwt_auth_enabled": service.jwt is not None,
            "proto_compress_fwdbwd": service.config.compress_fwdbwd,
            "parallel_fwdbwd_chunks": True,
            "fwdbwd_max_chunk_len": service.config.fwdbwd_max_chunk_len,
        }

    @route("POST", "/client/dynamic_config")
    async def dynamic_config(request: Request) -> dict:
        owner(request)
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @route("POST", "/create_session")
    async def create_session(request: Request) -> dict:
        who = owner(request)
        req = await parse(request, tt.CreateSessionRequest)
        session_id = service.sessions.create(who, req.user_metadata, req.display_name)
        return {"type": "create_session", "session_id": session_id}

    @route("POST", "/session_heartbeat")
    async def heartbeat(request: Request) -> Any:
        who = owner(request)
        req = await parse(request, tt.SessionHeartbeatRequest)
        try:
            service.sessions.check(who, req.session_id)
        except NotFound as exc:  # 410 ends the SDK's heartbeat loop
            return JSONResponse({"detail": f"gone: {exc.args[0]}"}, status_code=410)
        return {"type": "session_heartbeat"}

    @route("POST", "/telemetry")
    async def telemetry(request: Request) -> dict:
        owner(request)
        return {"status": "accepted"}

    @route("POST", "/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> dict:
        who = owner(request)
        if session_id in service.sessions.owned(who):  # finishing twice is not an error
            service.end_session(session_id)
        return {}

    @route("GET", "/sessions")
    async def list_sessions(request: Request, offset: int = 0, limit: int = 20) -> dict:
        _check_page(offset, limit)
        return {"sessions": service.sessions.owned(owner(request))[offset : offset + limit]}

    @route("GET", "/sessions/{session_id}")
    async def get_session(session_id: str, request: Request) -> dict:
        session = service.sessions.check(owner(request), session_id)
        return {
            "training_run_ids": list(session.model_ids),
            "sampler_ids": list(session.sampler_ids),
            "user_metadata": session.user_metadata,
            "display_name": session.display_name,
        }

    @route("POST", "/unload_model")
    async def unload_model(request: Request) -> dict:
        who = owner(request)
        req = await parse(request, tt.UnloadModelRequest)
        return {"request_id": service.training.unload(who, req.model_id)}

    @route("GET", "/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @route("GET", "/get_server_capabilities")
    async def capabilities(request: Request) -> dict:
        owner(request)
        return service.capabilities()

    # ------------------------------------------------------------ training

    @route("POST", "/create_model")
    async def create_model(request: Request) -> dict:
        who = owner(request)
        req = await parse(request, tt.CreateModelRequest)
        return {"request_id": service.training.create_model(who, req)}

    @route("POST", "/get_info")
    async def get_info(request: Request) -> dict:
        who = owner(request)
        req = await parse(request, tt.GetInfoRequest)
        return service.training.get_info(who, req.model_id)

    @route("POST", "/forward_backward")
    async def forward_backward(request: Request) -> dict:
        who = owner(request)
        body = await raw(request)
        encoding = request.headers.get("content-encoding")
        decoded = await run_in_threadpool(
            service.decode_forward_backward, body, encoding, max_body_bytes
        )
        return {"request_id": service.training.forward_backward(who, decoded, fingerprint(body))}

    @route("POST", "/optim_step")
    async def optim_step(request: Request) -> dict:
        who = owner(request)
        req, digest = await parse_seq_op(request, who, tt.OptimStepRequest)
        return {"request_id": service.training.optim_step(who, req, digest)}

    @route("POST", "/save_weights")
    async def save_weights(request: Request) -> dict:
        who = owner(request)
        req, digest = await parse_seq_op(request, who, tt.SaveWeightsRequest)
        return {"request_id": service.runs.save_weights(who, req, digest)}

    @route("POST", "/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict:
        who = owner(request)
        req, digest = await parse_seq_op(request, who, tt.SaveWeightsForSamplerRequest)
        return {"request_id": service.runs.save_weights_for_sampler(who, req, digest)}

    @route("POST", "/load_weights")
    async def load_weights(request: Request) -> dict:
        who = owner(request)
        req, digest = await parse_seq_op(request, who, tt.LoadWeightsRequest)
        return {"request_id": service.runs.load_weights(who, req, digest)}

    # ------------------------------------------------------------ sampling

    @route("POST", "/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        who = owner(request)
        req = await parse(request, tt.CreateSamplingSessionRequest)
        sampler_id = await run_in_threadpool(service.sampling.create_sampling_session, who, req)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @route("GET", "/samplers/{sampler_id}")
    async def sampler(sampler_id: str, request: Request) -> dict:
        return service.sampling.sampler_info(owner(request), sampler_id)

    @route("POST", "/asample")
    async def asample(request: Request) -> dict:
        who = owner(request)
        req = await parse(request, tt.SampleRequest)
        request_id, sequence_ids = service.sampling.sample(who, req)  # queues; never waits
        return {"request_id": request_id, "sample_sequence_ids": sequence_ids}

    # ------------------------------------------------------------ futures

    @route("POST", "/retrieve_future")
    async def retrieve_future(request: Request) -> Any:
        who = owner(request)
        req = await parse(request, tt.FutureRetrieveRequest)
        if service.futures.owner(req.request_id) != who:
            return JSONResponse(
                {"error": f"unknown request_id {req.request_id!r}", "category": "user"}
            )
        done, result = await service.futures.wait(req.request_id)
        if not done:
            return {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
        if isinstance(result, Failure):
            return JSONResponse({"error": result.error, "category": result.category})
        if isinstance(result, bytes):
            return Response(result, media_type=proto.PROTOBUF)
        return result

    # ------------------------------------------------------------ runs and checkpoints

    @route("GET", "/training_runs")
    async def training_runs(request: Request, offset: int = 0, limit: int = 100) -> dict:
        _check_page(offset, limit)
        runs = service.runs.training_runs(owner(request))
        page = runs[offset : offset + limit]
        return {
            "training_runs": page,
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)},
        }

    @route("GET", "/training_runs/{run_id}")
    async def training_run(run_id: str, request: Request) -> dict:
        return service.runs.training_run(owner(request), run_id)

    @route("GET", "/training_runs/{run_id}/checkpoints")
    async def run_checkpoints(run_id: str, request: Request) -> dict:
        return {"checkpoints": service.runs.checkpoints(owner(request), run_id)}

    @route("GET", "/checkpoints")
    async def all_checkpoints(request: Request, offset: int = 0, limit: int = 100) -> dict:
        _check_page(offset, limit)
        who = owner(request)
        runs = [r["training_run_id"] for r in service.runs.training_runs(who)]
        found = [c for run in runs for c in service.runs.checkpoints(who, run)]
        return {
            "checkpoints": found[offset : offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(found)},
        }

    @route("DELETE", "/training_runs/{run_id}/checkpoints/{segment}/{name}")
    async def delete_checkpoint(run_id: str, segment: str, name: str, request: Request) -> dict:
        service.runs.delete_checkpoint(owner(request), run_id, segment, name)
        return {}

    @route("POST", "/weights_info")
    async def weights_info(request: Request) -> dict:
        who = owner(request)
        body = await raw(request)
        try:
            path = pydantic.TypeAdapter(dict[str, Any]).validate_json(body)["tinker_path"]
        except (pydantic.ValidationError, KeyError):
            raise InputError("tinker_path: required") from None
        return service.runs.weights_info(who, path)

    @route("POST", "/save_weights_external")
    async def save_weights_external(request: Request) -> dict:
        who = owner(request)
        req, digest = await parse_seq_op(request, who, tt.SaveWeightsExternalRequest)
        return {"request_id": service.runs.save_weights_external(who, req, digest)}

    checkpoint = "/training_runs/{run_id}/checkpoints/{segment}/{name}"

    @route("GET", checkpoint + "/external_weights_urls")
    async def external_weights_urls(run_id: str, segment: str, name: str, request: Request) -> dict:
        """One download URL per file, on this server, valid until ``expires``."""
        who = owner(request)
        tokens, expires = await run_in_threadpool(
            service.runs.external_weights_urls, who, run_id, segment, name
        )
        base = f"{str(request.base_url).rstrip('/')}{PREFIX}/training_runs/{quote(run_id)}"
        base += f"/checkpoints/{segment}/{quote(name)}/files/"
        urls = {f: f"{base}{quote(f)}?token={quote(t)}" for f, t in tokens.items()}
        return {"urls": urls, "expires": iso_time(expires)}

    @route("GET", checkpoint + "/files/{file:path}")
    async def external_weights_file(
        run_id: str, segment: str, name: str, file: str, request: Request, token: str = ""
    ) -> FileResponse:
        """A file of an external-weights export: for the URL's token (plain downloaders send
        no headers) or, without one, for the request's key."""
        who = download_owner(request, token, run_id, segment, name, file)
        path = service.runs.external_file(who, run_id, segment, name, file)
        return FileResponse(path, media_type="application/octet-stream")

    @route("GET", checkpoint + "/archive")
    async def checkpoint_archive_url(
        run_id: str, segment: str, name: str, request: Request
    ) -> JSONResponse:
        """A sampler snapshot's archive (``get_checkpoint_archive_url`` of SDKs up to 0.37):
        a 302 to a signed URL on this server that answers the tar, with ``Expires``, the
        contract every such SDK reads; the body repeats both as ``{url, expires}``."""
        who = owner(request)
        token, expires = await run_in_threadpool(
            service.runs.archive_url, who, run_id, segment, name
        )
        url = f"{str(request.base_url).rstrip('/')}{PREFIX}/training_runs/{quote(run_id)}"
        url += f"/checkpoints/{segment}/{quote(name)}/{ARCHIVE_FILE}?token={quote(token)}"
        headers = {"Location": url, "Expires": formatdate(expires, usegmt=True)}
        body = {"url": url, "expires": iso_time(expires)}
        return JSONResponse(body, status_code=302, headers=headers)

    @route("GET", checkpoint + "/" + ARCHIVE_FILE)
    async def checkpoint_archive(
        run_id: str, segment: str, name: str, request: Request, token: str = ""
    ) -> StreamingResponse:
        """The tar of a sampler snapshot, streamed: for the URL's token or the owner's key."""
        who = download_owner(request, token, run_id, segment, name, ARCHIVE_FILE)
        archive = await run_in_threadpool(service.runs.archive, who, run_id, segment, name)
        headers = {
            "Content-Length": str(archive.length),
            "Content-Disposition": f'attachment; filename="{name}.tar"',
        }
        # a sync iterator: Starlette reads the files in its thread pool, off the event loop
        return StreamingResponse(archive.chunks(), media_type="application/x-tar", headers=headers)

    def download_owner(
        request: Request, token: str, run_id: str, segment: str, name: str, file: str
    ) -> str:
        """Whom a download is for: the URL's token (plain downloaders send no headers) or,
        without one, the request's key."""
        if not token:
            return owner(request)
        try:
            return service.runs.download_owner(token, run_id, segment, name, file)
        except InvalidDownloadToken as exc:
            raise Unauthorized(str(exc)) from None

    @route("PUT", checkpoint + "/ttl")
    async def set_checkpoint_ttl(run_id: str, segment: str, name: str, request: Request) -> dict:
        who = owner(request)
        fields = _loose_fields(await raw(request))
        if "ttl_seconds" not in fields:
            raise InputError("ttl_seconds: required (null removes the expiry)")
        service.runs.set_ttl(who, run_id, segment, name, fields["ttl_seconds"])
        return {}

    @route("POST", "/copy_weights")
    async def copy_weights(request: Request) -> dict:
        who = owner(request)
        req = await parse(request, tt.CopyWeightsRequest)
        key = request.headers.get("x-idempotency-key", "")
        path = await run_in_threadpool(service.runs.copy_weights, who, req, key)
        return {"tinker_path": path}

    # ------------------------------------------------------------ auth (opt-in JWT mode)

    @route("POST", "/auth/token")
    async def auth_token(request: Request) -> dict:
        """Exchange a key (never a token) for a short-lived JWT: ``--jwt-auth`` only."""
        if service.jwt is None:
            raise NotFound("auth/token: JWT auth is off (start the server with --jwt-auth)")
        key = request.headers.get("x-api-key", "")
        if looks_like_jwt(key):
            raise Unauthorized("X-API-Key: exchange a tml-... key, not a token")
        return {"jwt": service.jwt.issue(key_owner(key))}

    return app


MAX_PAGE = 1000


async def _reap_forever(service: Service) -> None:
    """Silent sessions end and idle snapshot engines go, on the event loop (what they touch
    lives there); a failed round is logged and the next one runs."""
    while True:
        await asyncio.sleep(service.reap_interval)
        try:
            service.reap()
        except Exception:  # noqa: BLE001 - the reaper must outlive one bad round
            log.exception("session reaper")


def _validate(cls: type[T], body: bytes) -> T:
    try:
        return cls.model_validate_json(body)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if not _union_tag(p)) or "body"
        raise InputError(f"{where}: {first['msg']}") from None


def _union_tag(part: object) -> bool:
    """pydantic names the union member it tried in the error path (``AdamParams``): not a
    field the client wrote."""
    return isinstance(part, str) and part[:1].isupper() and part.isidentifier()


def _loose_fields(body: bytes) -> dict[str, Any]:
    """The top-level fields of a JSON object body that failed validation ({} if none)."""
    try:
        fields = pydantic.TypeAdapter(dict[str, Any]).validate_json(body)
    except pydantic.ValidationError:
        return {}
    return fields


def _check_page(offset: int, limit: int) -> None:
    if offset < 0:
        raise InputError(f"offset: must be >= 0, got {offset}")
    if not 1 <= limit <= MAX_PAGE:
        raise InputError(f"limit: must be in [1, {MAX_PAGE}], got {limit}")
