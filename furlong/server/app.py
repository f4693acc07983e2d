"""The HTTP app of ``furlong serve`` (Tinker's wire protocol under ``/api/v1``): the routers
of ``routes/``, one per concern, mounted behind the shared key check, with the error handlers.

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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from furlong.server.routes import (
    PREFIX,
    checkpoints,
    exports,
    futures,
    handshake,
    listings,
    sampling,
    sessions,
    training,
)
from furlong.server.routes.deps import Context, owner
from furlong.server.routes.errors import ERROR_HANDLERS
from furlong.server.service import Service

log = logging.getLogger("furlong.serve")

KEYED = (  # every route of these needs a valid key (or JWT) first
    handshake.router,
    sessions.router,
    training.router,
    sampling.router,
    futures.router,
    checkpoints.router,
    exports.router,
)
# these check their caller themselves: not at all (health) or the key alone (auth/token), the
# page before the key (listings), a download URL's token or else the key (downloads)
SELF_CHECKED = (handshake.public, listings.router, exports.downloads)


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

    app = FastAPI(
        title="furlong (Tinker protocol)", lifespan=lifespan, exception_handlers=ERROR_HANDLERS
    )
    app.state.context = Context(service, api_keys, max_body_bytes)
    for router in KEYED:
        app.include_router(router, prefix=PREFIX, dependencies=[Depends(owner)])
    for router in SELF_CHECKED:
        app.include_router(router, prefix=PREFIX)
    return app


async def _reap_forever(service: Service) -> None:
    """Silent sessions end and idle snapshot engines go, on the event loop (what they touch
    lives there); a failed round is logged and the next one runs."""
    while True:
        await asyncio.sleep(service.reap_interval)
        try:
            service.reap()
        except Exception:  # noqa: BLE001 - the reaper must outlive one bad round
            log.exception("session reaper")
