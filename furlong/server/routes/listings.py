"""The lists of a tenant's sessions, training runs and checkpoints. Mounted without the
shared key check: a paged route checks its page before the key (``paged``), so each route here
declares its caller itself."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from furlong.server.routes.deps import Owner, Page, ServiceDep, paged

router = APIRouter()
SessionsPage = Annotated[Page, Depends(paged(20))]
RunsPage = Annotated[Page, Depends(paged(100))]


@router.get("/sessions")
async def list_sessions(page: SessionsPage, service: ServiceDep) -> dict:
    return {"sessions": page.of(service.sessions.owned(page.owner))}


@router.get("/training_runs")
async def training_runs(page: RunsPage, service: ServiceDep) -> dict:
    runs = service.runs.training_runs(page.owner)
    return {"training_runs": page.of(runs), "cursor": page.cursor(len(runs))}


@router.get("/training_runs/{run_id}")
async def training_run(run_id: str, who: Owner, service: ServiceDep) -> dict:
    return service.runs.training_run(who, run_id)


@router.get("/training_runs/{run_id}/checkpoints")
async def run_checkpoints(run_id: str, who: Owner, service: ServiceDep) -> dict:
    return {"checkpoints": service.runs.checkpoints(who, run_id)}


@router.get("/checkpoints")
async def all_checkpoints(page: RunsPage, service: ServiceDep) -> dict:
    runs = [r["training_run_id"] for r in service.runs.training_runs(page.owner)]
    found = [c for run in runs for c in service.runs.checkpoints(page.owner, run)]
    return {"checkpoints": page.of(found), "cursor": page.cursor(len(found))}
