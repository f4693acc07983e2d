"""Sampling sessions and ``asample`` (which queues and never waits)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from tinker import types as tt

from furlong.server.routes.bodies import parse
from furlong.server.routes.deps import Owner, ServiceDep

router = APIRouter()


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request, who: Owner, service: ServiceDep) -> dict:
    req = await parse(request, tt.CreateSamplingSessionRequest)
    sampler_id = await run_in_threadpool(service.sampling.create_sampling_session, who, req)
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


@router.get("/samplers/{sampler_id}")
async def sampler(sampler_id: str, who: Owner, service: ServiceDep) -> dict:
    return service.sampling.sampler_info(who, sampler_id)


@router.post("/asample")
async def asample(request: Request, who: Owner, service: ServiceDep) -> dict:
    req = await parse(request, tt.SampleRequest)
    request_id, sequence_ids = service.sampling.sample(who, req)  # queues; never waits
    return {"request_id": request_id, "sample_sequence_ids": sequence_ids}
