"""Checkpoints: save (training state, or a sampler snapshot) and load them in ``seq_id`` order,
copy, delete, set their TTL, and describe the weights a path names."""

from __future__ import annotations

from typing import Any

import pydantic
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from tinker import types as tt

from furlong.errors import InputError
from furlong.server.routes.bodies import loose_fields, parse, parse_seq_op, read_body
from furlong.server.routes.deps import Owner, ServiceDep

router = APIRouter()
CHECKPOINT = "/training_runs/{run_id}/checkpoints/{segment}/{name}"


@router.post("/save_weights")
async def save_weights(request: Request, who: Owner, service: ServiceDep) -> dict:
    req, digest = await parse_seq_op(request, who, tt.SaveWeightsRequest)
    return {"request_id": service.runs.save_weights(who, req, digest)}


@router.post("/save_weights_for_sampler")
async def save_for_sampler(request: Request, who: Owner, service: ServiceDep) -> dict:
    req, digest = await parse_seq_op(request, who, tt.SaveWeightsForSamplerRequest)
    return {"request_id": service.runs.save_weights_for_sampler(who, req, digest)}


@router.post("/load_weights")
async def load_weights(request: Request, who: Owner, service: ServiceDep) -> dict:
    req, digest = await parse_seq_op(request, who, tt.LoadWeightsRequest)
    return {"request_id": service.runs.load_weights(who, req, digest)}


@router.delete(CHECKPOINT)
async def delete_checkpoint(
    run_id: str, segment: str, name: str, who: Owner, service: ServiceDep
) -> dict:
    service.runs.delete_checkpoint(who, run_id, segment, name)
    return {}


@router.post("/weights_info")
async def weights_info(request: Request, who: Owner, service: ServiceDep) -> dict:
    body = await read_body(request)
    try:
        path = pydantic.TypeAdapter(dict[str, Any]).validate_json(body)["tinker_path"]
    except (pydantic.ValidationError, KeyError):
        raise InputError("tinker_path: required") from None
    return service.runs.weights_info(who, path)


@router.put(CHECKPOINT + "/ttl")
async def set_checkpoint_ttl(
    run_id: str, segment: str, name: str, request: Request, who: Owner, service: ServiceDep
) -> dict:
    fields = loose_fields(await read_body(request))
    if "ttl_seconds" not in fields:
        raise InputError("ttl_seconds: required (null removes the expiry)")
    service.runs.set_ttl(who, run_id, segment, name, fields["ttl_seconds"])
    return {}


@router.post("/copy_weights")
async def copy_weights(request: Request, who: Owner, service: ServiceDep) -> dict:
    req = await parse(request, tt.CopyWeightsRequest)
    key = request.headers.get("x-idempotency-key", "")
    path = await run_in_threadpool(service.runs.copy_weights, who, req, key)
    return {"tinker_path": path}
