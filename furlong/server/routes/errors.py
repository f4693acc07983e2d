"""How refusals reach the client: each exception type's status and ``{"detail"}`` body."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from furlong.errors import InputError
from furlong.server.jwt_auth import InvalidToken
from furlong.server.ordering import Conflict
from furlong.server.routes.bodies import TooLarge
from furlong.server.routes.deps import Unauthorized
from furlong.server.sessions import NotFound

Handler = Callable[[Request, Any], Coroutine[Any, Any, Response]]  # FastAPI's handler type


def _status(code: int) -> Handler:
    async def handle(_r: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=code)

    return handle


async def _not_found(_r: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": f"not found: {exc.args[0]}"}, status_code=404)


async def _invalid_token(_r: Request, exc: Exception) -> JSONResponse:
    # RFC 6750's marker: the SDK exchanges its key for a new token and replays once
    header = {"WWW-Authenticate": 'Bearer error="invalid_token"'}
    return JSONResponse({"detail": str(exc)}, status_code=401, headers=header)


ERROR_HANDLERS: dict[int | type[Exception], Handler] = {
    InputError: _status(400),
    NotFound: _not_found,
    Unauthorized: _status(401),
    InvalidToken: _invalid_token,
    Conflict: _status(409),
    TooLarge: _status(413),
}
