"""The session server over HTTP (FastAPI). An agent harness only needs a session's base URL,
``{server}/sessions/{id}/v1``, where it finds an OpenAI-compatible ``/chat/completions``; the
session id in it is the agent's only credential. Everything else is control, for the RL
driver and the trainer, and asks for the admin token when the server has one
(``Authorization: Bearer <token>``; see :mod:`furlong.rollout.control`).

    agents:
    POST   /sessions/{id}/v1/chat/completions  one turn (OpenAI request and response shape);
                                               a client that hangs up aborts its turn
    GET    /sessions/{id}/v1/models            the served model (OpenAI clients ask for it)
    control:
    POST   /sessions                           open: {"id", "base_url"}
    GET    /sessions/{id}                      the checkpoint tokens, the turn records and
                                               the turns that never committed
    POST   /sessions/{id}/samples              the trajectory as training samples: the codec's
                                               payload (Accept: application/x-furlong-samples)
                                               or JSON; ?fields= opts in to optional fields
    DELETE /sessions/{id}                      close (a turn in flight is aborted)
    POST   /weights                            publish weights from a safetensors file or HF
                                               directory (inside ``weights_dir`` when set),
                                               under the configured pause mode

Errors use OpenAI's shape ``{"error": {"message", "type"}}``: 400 malformed requests (the
message names the field), 401 a control route without the admin token, 404 unknown sessions,
422 routed-expert assembly failures (naming the record), 413 a body over the limit, 429 too
many sessions, 503 a turn aborted by the engine (retry it).
"""

from __future__ import annotations

import asyncio

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from furlong.errors import InputError
from furlong.rollout.codec import MEDIA_TYPE, encode_samples, payload_fields
from furlong.rollout.control import ControlPolicy, Unauthorized
from furlong.rollout.sessions.r3 import AssemblyError
from furlong.rollout.sessions.service import (
    SessionNotFound,
    SessionServer,
    TooManySessions,
    TurnAborted,
)
from furlong.rollout.sessions.wire import parse_fields, sample_to_json, wants_codec
from furlong.serving import ClientGone, read_json_object, unless_disconnected

# Bodies past this are refused (413) as they arrive; a conversation that fills a 128k-token
# context is a few MB of JSON.
MAX_BODY_BYTES = 16 << 20

_ERRORS: dict[type[Exception], tuple[int, str]] = {
    AssemblyError: (422, "assembly_error"),
    InputError: (400, "invalid_request_error"),
    Unauthorized: (401, "authentication_error"),
    SessionNotFound: (404, "not_found_error"),
    TooManySessions: (429, "rate_limit_error"),
    TurnAborted: (503, "turn_aborted"),
}


def _error(status: int, kind: str, message: str) -> JSONResponse:
    headers = {503: {"Retry-After": "1"}, 401: {"WWW-Authenticate": "Bearer"}}.get(status)
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(
    server: SessionServer,
    max_body_bytes: int = MAX_BODY_BYTES,
    policy: ControlPolicy | None = None,
) -> FastAPI:
    """``policy``: the admin token and weights directory (default: none, for a server in a
    trusted process; ``furlong session-server`` always has a token)."""
    policy = policy or ControlPolicy()
    app = FastAPI(title="furlong session server", max_body_size=max_body_bytes)
    app.state.sessions = server

    def admin(request: Request) -> None:
        policy.require_admin(request.headers)

    control = [Depends(admin)]  # checked before the body is read or anything is looked up

    for exc_type, (status, kind) in _ERRORS.items():

        async def handler(
            _request: Request, exc: Exception, s: int = status, k: str = kind
        ) -> JSONResponse:
            return _error(s, k, str(exc.args[0]) if exc.args else type(exc).__name__)

        app.add_exception_handler(exc_type, handler)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 413:
            message = f"body: over the server's limit of {max_body_bytes} bytes"
            return _error(413, "invalid_request_error", message)
        return _error(exc.status_code, "invalid_request_error", str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _bad_schema(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, "invalid_request_error", f"request: {exc.errors()}")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "sessions": len(server.sessions)}

    @app.post("/sessions", dependencies=control)
    async def open_session(request: Request) -> dict:
        body = await read_json_object(request, required=False, allowed=("return_sampling_mask",))
        session = server.open(body.get("return_sampling_mask", False))
        return {"id": session.id, "base_url": f"/sessions/{session.id}/v1"}

    @app.get("/sessions/{session_id}", dependencies=control)
    async def session_info(session_id: str) -> dict:
        session = server.get(session_id)
        return {
            "id": session.id,
            "tokens": session.tokens,
            "records": [r.summary(i) for i, r in enumerate(session.records)],
            "aborted": [a.summary() for a in session.aborted],
            "use_addition_r3": server.use_addition_r3,
            "routing_replay": server.replay,
        }

    @app.delete("/sessions/{session_id}", dependencies=control)
    async def close_session(session_id: str) -> dict:
        await server.close(session_id)
        return {"id": session_id, "deleted": True}

    @app.post("/sessions/{session_id}/v1/chat/completions", response_model=None)
    async def chat(session_id: str, request: Request) -> dict | Response:
        server.get(session_id)  # 404 before reading the body
        body = await read_json_object(request, required=False)
        try:  # a client that hangs up stops its turn: the engine aborts it, nothing commits
            return await unless_disconnected(request, server.chat(session_id, body))
        except ClientGone:
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.get("/sessions/{session_id}/v1/models")
    async def models(session_id: str) -> dict:
        server.get(session_id)
        name = server.config.model_name
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "furlong"}]}

    @app.post("/sessions/{session_id}/samples", dependencies=control)
    async def samples(session_id: str, request: Request) -> Response:
        wanted = parse_fields(request.query_params.get("fields", ""))
        body = await read_json_object(request, required=False, allowed=("reward", "max_length"))
        sample = server.sample(session_id, body.get("reward"), body.get("max_length"))
        fields = payload_fields([sample], wanted)  # what was asked, and all the sample carries
        if wants_codec(request.headers.get("accept", "")):
            return Response(encode_samples([sample], fields), media_type=MEDIA_TYPE)
        return JSONResponse({"samples": [sample_to_json(sample, fields)]})

    @app.post("/weights", dependencies=control)
    async def publish(request: Request) -> dict:
        """For a trainer in another process; in process, call ``server.publish_weights``."""
        body = await read_json_object(request, required=False, allowed=("path", "version"))
        path, version = body.get("path"), body.get("version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise InputError(f"version: expected an integer or null, got {version!r}")
        weights = await asyncio.to_thread(policy.load_weights, path)
        new = await asyncio.to_thread(server.publish_weights, weights, version)
        return {"weight_version": new}

    return app
