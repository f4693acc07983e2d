"""Weights that leave the server: ``save_weights_external``, the signed URLs of its files and
of a sampler snapshot's archive (``router``, behind the key check), and the downloads those
URLs name (``downloads``: for the URL's token, since plain downloaders send no headers, or
without one for the key)."""

from __future__ import annotations

from email.utils import formatdate
from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from tinker import types as tt

from furlong.server.checkpoint_archive import ARCHIVE_FILE
from furlong.server.external_weights import InvalidDownloadToken
from furlong.server.routes import PREFIX
from furlong.server.routes.bodies import parse_seq_op
from furlong.server.routes.checkpoints import CHECKPOINT
from furlong.server.routes.deps import Owner, ServiceDep, Unauthorized, context, owner
from furlong.server.state import iso_time

router = APIRouter()
downloads = APIRouter()


async def download_owner(request: Request, token: str = "") -> str:
    """Whom a download is for: the URL's token (plain downloaders send no headers) or,
    without one, the request's key."""
    if not token:
        return await owner(request)
    p = request.path_params  # the file: the route's {file}, or the archive's fixed name
    runs = context(request).service.runs
    try:
        file = p.get("file", ARCHIVE_FILE)
        return runs.download_owner(token, p["run_id"], p["segment"], p["name"], file)
    except InvalidDownloadToken as exc:
        raise Unauthorized(str(exc)) from None


DownloadOwner = Annotated[str, Depends(download_owner)]


def _checkpoint_url(request: Request, run_id: str, segment: str, name: str) -> str:
    base = f"{str(request.base_url).rstrip('/')}{PREFIX}/training_runs/{quote(run_id)}"
    return f"{base}/checkpoints/{segment}/{quote(name)}"


@router.post("/save_weights_external")
async def save_weights_external(request: Request, who: Owner, service: ServiceDep) -> dict:
    req, digest = await parse_seq_op(request, who, tt.SaveWeightsExternalRequest)
    return {"request_id": service.runs.save_weights_external(who, req, digest)}


@router.get(CHECKPOINT + "/external_weights_urls")
async def external_weights_urls(
    run_id: str, segment: str, name: str, request: Request, who: Owner, service: ServiceDep
) -> dict:
    """One download URL per file, on this server, valid until ``expires``."""
    tokens, expires = await run_in_threadpool(
        service.runs.external_weights_urls, who, run_id, segment, name
    )
    base = _checkpoint_url(request, run_id, segment, name) + "/files/"
    urls = {f: f"{base}{quote(f)}?token={quote(t)}" for f, t in tokens.items()}
    return {"urls": urls, "expires": iso_time(expires)}


@downloads.get(CHECKPOINT + "/files/{file:path}")
async def external_weights_file(
    run_id: str, segment: str, name: str, file: str, who: DownloadOwner, service: ServiceDep
) -> FileResponse:
    """A file of an external-weights export: for the URL's token (plain downloaders send
    no headers) or, without one, for the request's key."""
    path = service.runs.external_file(who, run_id, segment, name, file)
    return FileResponse(path, media_type="application/octet-stream")


@router.get(CHECKPOINT + "/archive")
async def checkpoint_archive_url(
    run_id: str, segment: str, name: str, request: Request, who: Owner, service: ServiceDep
) -> JSONResponse:
    """A sampler snapshot's archive (``get_checkpoint_archive_url`` of SDKs up to 0.37):
    a 302 to a signed URL on this server that answers the tar, with ``Expires``, the
    contract every such SDK reads; the body repeats both as ``{url, expires}``."""
    token, expires = await run_in_threadpool(service.runs.archive_url, who, run_id, segment, name)
    url = f"{_checkpoint_url(request, run_id, segment, name)}/{ARCHIVE_FILE}?token={quote(token)}"
    headers = {"Location": url, "Expires": formatdate(expires, usegmt=True)}
    body = {"url": url, "expires": iso_time(expires)}
    return JSONResponse(body, status_code=302, headers=headers)


@downloads.get(CHECKPOINT + "/" + ARCHIVE_FILE)
async def checkpoint_archive(
    run_id: str, segment: str, name: str, who: DownloadOwner, service: ServiceDep
) -> StreamingResponse:
    """The tar of a sampler snapshot, streamed: for the URL's token or the owner's key."""
    archive = await run_in_threadpool(service.runs.archive, who, run_id, segment, name)
    headers = {
        "Content-Length": str(archive.length),
        "Content-Disposition": f'attachment; filename="{name}.tar"',
    }
    # a sync iterator: Starlette reads the files in its thread pool, off the event loop
    return StreamingResponse(archive.chunks(), media_type="application/x-tar", headers=headers)
