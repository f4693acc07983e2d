"""``retrieve_future``: an operation's result once done (long-polled), or ``try_again``.
Execution errors come back here as HTTP 200 ``{"error", "category"}``, as Tinker's do."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from tinker import types as tt

from furlong.server import proto
from furlong.server.futures import Failure
from furlong.server.routes.bodies import parse
from furlong.server.routes.deps import Owner, ServiceDep

router = APIRouter()


@router.post("/retrieve_future")
async def retrieve_future(request: Request, who: Owner, service: ServiceDep) -> Any:
    req = await parse(request, tt.FutureRetrieveRequest)
    if service.futures.owner(req.request_id) != who:
        return JSONResponse({"error": f"unknown request_id {req.request_id!r}", "category": "user"})
    done, result = await service.futures.wait(req.request_id)
    if not done:
        return {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
    if isinstance(result, Failure):
        return JSONResponse({"error": result.error, "category": result.category})
    if isinstance(result, bytes):
        return Response(result, media_type=proto.PROTOBUF)
    return result
