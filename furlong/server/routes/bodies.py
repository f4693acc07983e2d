"""Request bodies: read in chunks up to the app's limit (413 beyond it), and parsed with the
``tinker`` SDK's own pydantic types (400 naming the first bad field)."""

from __future__ import annotations

from typing import Any, TypeVar

import pydantic
from fastapi import Request

from furlong.errors import InputError
from furlong.server.routes.deps import context
from furlong.server.service import fingerprint

T = TypeVar("T", bound=pydantic.BaseModel)


class TooLarge(Exception):
    pass


async def read_body(request: Request) -> bytes:
    limit = context(request).max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:  # refuse before reading it
        raise TooLarge(f"body: {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():  # a chunked body has no length to check first
        body += chunk
        if len(body) > limit:
            raise TooLarge(f"body: more than {limit} bytes; the limit is {limit}")
    return bytes(body)


async def parse(request: Request, cls: type[T]) -> T:
    return validate(cls, await read_body(request))


async def parse_seq_op(request: Request, who: str, cls: type[T]) -> tuple[T, bytes]:
    """A seq-numbered request and its fingerprint; a body that fails validation still
    consumes the ``seq_id`` it names."""
    body = await read_body(request)
    digest = fingerprint(body)
    try:
        return validate(cls, body), digest
    except InputError as exc:
        context(request).service.training.refuse(who, loose_fields(body), exc, digest)
        raise


def validate(cls: type[T], body: bytes) -> T:
    try:
        return cls.model_validate_json(body)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if not _union_tag(p)) or "body"
        raise InputError(f"{where}: {first['msg']}") from None


def _union_tag(part: object) -> bool:
    """pydantic names the union member it tried in the error path (``AdamParams``): not a
    field the client wrote."""
    return isinstance(part, str) and part[:1].isupper() and part.isidentifier()


def loose_fields(body: bytes) -> dict[str, Any]:
    """The top-level fields of a JSON object body that failed validation ({} if none)."""
    try:
        fields = pydantic.TypeAdapter(dict[str, Any]).validate_json(body)
    except pydantic.ValidationError:
        return {}
    return fields
