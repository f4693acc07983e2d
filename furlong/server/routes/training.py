"""Training models: create, describe and unload them; ``forward_backward`` and ``optim_step``
(seq-numbered: a refused body still consumes its ``seq_id``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from tinker import types as tt

from furlong.server.routes.bodies import parse, parse_seq_op, read_body
from furlong.server.routes.deps import Owner, ServiceDep, context
from furlong.server.service import fingerprint

router = APIRouter()


@router.post("/create_model")
async def create_model(request: Request, who: Owner, service: ServiceDep) -> dict:
    req = await parse(request, tt.CreateModelRequest)
    return {"request_id": service.training.create_model(who, req)}


@router.post("/get_info")
async def get_info(request: Request, who: Owner, service: ServiceDep) -> dict:
    req = await parse(request, tt.GetInfoRequest)
    return service.training.get_info(who, req.model_id)


@router.post("/unload_model")
async def unload_model(request: Request, who: Owner, service: ServiceDep) -> dict:
    req = await parse(request, tt.UnloadModelRequest)
    return {"request_id": service.training.unload(who, req.model_id)}


@router.post("/forward_backward")
async def forward_backward(request: Request, who: Owner, service: ServiceDep) -> dict:
    body = await read_body(request)
    encoding = request.headers.get("content-encoding")
    # protobuf decoding is CPU work: off the event loop, so a heavy body blocks no one
    decoded = await run_in_threadpool(
        service.decode_forward_backward, body, encoding, context(request).max_body_bytes
    )
    return {"request_id": service.training.forward_backward(who, decoded, fingerprint(body))}


@router.post("/optim_step")
async def optim_step(request: Request, who: Owner, service: ServiceDep) -> dict:
    req, digest = await parse_seq_op(request, who, tt.OptimStepRequest)
    return {"request_id": service.training.optim_step(who, req, digest)}
