"""Client sessions: created, kept alive by the SDK's heartbeats, finished, looked up. (Their
paged list is in listings.py.)"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from tinker import types as tt

from furlong.server.routes.bodies import parse
from furlong.server.routes.deps import Owner, ServiceDep
from furlong.server.sessions import NotFound

router = APIRouter()


@router.post("/create_session")
async def create_session(request: Request, who: Owner, service: ServiceDep) -> dict:
    req = await parse(request, tt.CreateSessionRequest)
    session_id = service.sessions.create(who, req.user_metadata, req.display_name)
    return {"type": "create_session", "session_id": session_id}


@router.post("/session_heartbeat")
async def heartbeat(request: Request, who: Owner, service: ServiceDep) -> Any:
    req = await parse(request, tt.SessionHeartbeatRequest)
    try:
        service.sessions.check(who, req.session_id)
    except NotFound as exc:  # 410 ends the SDK's heartbeat loop
        return JSONResponse({"detail": f"gone: {exc.args[0]}"}, status_code=410)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish(session_id: str, who: Owner, service: ServiceDep) -> dict:
    if session_id in service.sessions.owned(who):  # finishing twice is not an error
        service.end_session(session_id)
    return {}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, who: Owner, service: ServiceDep) -> dict:
    session = service.sessions.check(who, session_id)
    return {
        "training_run_ids": list(session.model_ids),
        "sampler_ids": list(session.sampler_ids),
        "user_metadata": session.user_metadata,
        "display_name": session.display_name,
    }
