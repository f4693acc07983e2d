"""What routes declare with ``Depends``: the service and the caller (``Owner``: the tenant that
an ``X-API-Key`` names, checked once per request), and a listing's page.

The routers are module-level; ``create_app`` puts the :class:`Context` they serve on
``app.state``, so every app (tests make many) routes to its own service.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, TypeVar

from fastapi import Depends, Request

from furlong.errors import InputError
from furlong.server.jwt_auth import looks_like_jwt
from furlong.server.service import Service
from furlong.server.state import owner_id

MAX_PAGE = 1000
Item = TypeVar("Item")


class Unauthorized(Exception):
    pass


@dataclass(frozen=True)
class Context:
    service: Service
    api_keys: frozenset[str] | None  # None: any tml-... key is accepted
    max_body_bytes: int


def context(request: Request) -> Context:
    ctx: Context = request.app.state.context  # set by create_app
    return ctx


async def get_service(request: Request) -> Service:
    return context(request).service


async def owner(request: Request) -> str:
    """The tenant of a request: its ``X-API-Key``, or in JWT mode also a token that
    ``auth/token`` issued for a key (the SDK sends it in the same header)."""
    ctx = context(request)
    key = request.headers.get("x-api-key", "")
    if ctx.service.jwt is not None and looks_like_jwt(key):
        return ctx.service.jwt.verify(key)
    return key_owner(ctx, key)


def key_owner(ctx: Context, key: str) -> str:
    if ctx.api_keys is not None:
        if key not in ctx.api_keys:
            raise Unauthorized("X-API-Key: unknown key")
    elif not key.startswith("tml-"):
        raise Unauthorized("X-API-Key: expected a tml-... key")
    return owner_id(key)


ServiceDep = Annotated[Service, Depends(get_service)]
Owner = Annotated[str, Depends(owner)]


@dataclass(frozen=True)
class Page:
    owner: str
    offset: int
    limit: int

    def of(self, items: list[Item]) -> list[Item]:
        return items[self.offset : self.offset + self.limit]

    def cursor(self, total: int) -> dict[str, int]:
        return {"offset": self.offset, "limit": self.limit, "total_count": total}


def paged(default_limit: int) -> Callable[..., Awaitable[Page]]:
    """A listing's page, then its caller: offset and limit are declared here, not by the route,
    so a malformed one is refused (422, then 400) before the key is checked, as ever."""

    async def page(request: Request, offset: int = 0, limit: int = default_limit) -> Page:
        if offset < 0:
            raise InputError(f"offset: must be >= 0, got {offset}")
        if not 1 <= limit <= MAX_PAGE:
            raise InputError(f"limit: must be in [1, {MAX_PAGE}], got {limit}")
        return Page(await owner(request), offset, limit)

    return page
