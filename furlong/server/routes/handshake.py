"""Health, capabilities and what the SDK asks before its first request (client config,
telemetry), and in JWT mode the exchange of a key for a token."""

from __future__ import annotations

from fastapi import APIRouter, Request

from furlong.server.jwt_auth import looks_like_jwt
from furlong.server.routes.deps import ServiceDep, Unauthorized, context, key_owner
from furlong.server.sessions import NotFound

router = APIRouter()  # mounted behind the key check
public = APIRouter()  # no key: a health probe, and the exchange that checks its key itself


@router.post("/client/config")
async def client_config(service: ServiceDep) -> dict:
    return {
        "pjwt_auth_enabled": service.jwt is not None,
        "proto_compress_fwdbwd": service.config.compress_fwdbwd,
        "parallel_fwdbwd_chunks": True,
        "fwdbwd_max_chunk_len": service.config.fwdbwd_max_chunk_len,
    }


@router.post("/client/dynamic_config")
async def dynamic_config() -> dict:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/telemetry")
async def telemetry() -> dict:
    return {"status": "accepted"}


@public.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def capabilities(service: ServiceDep) -> dict:
    return service.capabilities()


@public.post("/auth/token")
async def auth_token(request: Request, service: ServiceDep) -> dict:
    """Exchange a key (never a token) for a short-lived JWT: ``--jwt-auth`` only."""
    if service.jwt is None:
        raise NotFound("auth/token: JWT auth is off (start the server with --jwt-auth)")
    key = request.headers.get("x-api-key", "")
    if looks_like_jwt(key):
        raise Unauthorized("X-API-Key: exchange a tml-... key, not a token")
    return {"jwt": service.jwt.issue(key_owner(context(request), key))}
