"""Opt-in JWT auth (``furlong serve --jwt-auth``), as the tinker SDK speaks it.

When ``client/config`` answers ``pjwt_auth_enabled: true``, the SDK posts ``auth/token`` with
its ``tml-`` key, gets ``{"jwt": ...}``, and from then on sends that token in ``X-API-Key``
(refreshing it at about half its lifetime, and once more when a request is answered 401 with
``WWW-Authenticate: Bearer error="invalid_token"``). ``RestClient.whoami()`` reads the token's
claims without a request: ``sub`` (the user URN), ``org_id`` and ``email``.

Tokens are HS256 JWTs under a secret of this server process (a restart invalidates them; the
SDK exchanges its key again). They name the tenant by its id, a hash of the key, never the key.
The SDK does not depend on PyJWT, so this is the few lines of RFC 7519 it needs.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import time
from collections.abc import Callable

LIFETIME = 3600  # seconds; the SDK refreshes at half of it, and on demand within 60 s of exp
ISSUER = "furlong"
USER_URN = "tml:user:"
_HEADER = {"alg": "HS256", "typ": "JWT"}
_OWNER = re.compile(r"[0-9a-f]{16}")  # state.owner_id's form


class InvalidToken(Exception):
    """A bearer token that is malformed, forged, from another server process, or expired."""


def looks_like_jwt(credential: str) -> bool:
    """The SDK's own test: a JWT's base64url JSON header starts ``eyJ``; keys start ``tml-``."""
    return credential.startswith("eyJ")


def user_urn(owner: str) -> str:
    return f"{USER_URN}{owner}"


class JwtAuth:
    def __init__(self, clock: Callable[[], float] = time.time, lifetime: int = LIFETIME):
        self._clock = clock
        self._lifetime = lifetime
        self._secret = secrets.token_bytes(32)

    def issue(self, owner: str) -> str:
        """A token for tenant ``owner`` (a key's ``owner_id``). Each tenant is its own
        organization here, as keys are the unit of isolation."""
        now = int(self._clock())
        claims = {
            "iss": ISSUER,
            "sub": user_urn(owner),
            "org_id": owner,
            "email": None,
            "iat": now,
            "exp": now + self._lifetime,
        }
        signing_input = f"{_b64(_HEADER)}.{_b64(claims)}"
        return f"{signing_input}.{self._sign(signing_input)}"

    def verify(self, token: str) -> str:
        """The tenant a genuine, unexpired token of this process was issued to."""
        parts = token.split(".")
        if len(parts) != 3:
            raise InvalidToken("X-API-Key: not a JWT")
        signing_input = f"{parts[0]}.{parts[1]}"
        if not hmac.compare_digest(parts[2].encode(), self._sign(signing_input).encode()):
            raise InvalidToken("X-API-Key: the token's signature does not verify (exchange again)")
        try:
            header, claims = _unb64(parts[0]), _unb64(parts[1])
        except ValueError:
            raise InvalidToken("X-API-Key: malformed token") from None
        if header.get("alg") != "HS256" or claims.get("iss") != ISSUER:
            raise InvalidToken("X-API-Key: token not issued by this server")
        exp = claims.get("exp")
        if not isinstance(exp, int) or self._clock() >= exp:
            raise InvalidToken("X-API-Key: token expired (exchange the key again)")
        owner = str(claims.get("sub", "")).removeprefix(USER_URN)
        if not _OWNER.fullmatch(owner):
            raise InvalidToken("X-API-Key: token names no tenant")
        return owner

    def _sign(self, signing_input: str) -> str:
        mac = hmac.new(self._secret, signing_input.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def _b64(obj: dict) -> str:
    raw = json.dumps(obj, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(part: str) -> dict:
    try:
        obj = json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
    except (ValueError, TypeError) as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj
