"""Who may call a rollout front end's control routes, and which weight files they may name.

The rollout server and the session server serve two kinds of caller on one port: generation
(agents, samplers) and control (the trainer: weight publication, pausing, session records). A
:class:`ControlPolicy` with an ``admin_token`` makes every control route ask for
``Authorization: Bearer <token>``; a ``weights_dir`` confines the paths a publication may load
to one directory (resolved first, so ``..`` and symlinks cannot leave it). Whatever goes wrong
with a path, the caller gets the same message: whether a file exists, or how large it is, is
not an answer the server gives (the detail goes to the server's log).

Torch-free to import (safetensors loads with the first weights), so the CLI checks its control
flags before anything heavy loads.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from furlong.errors import InputError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("furlong.control")

ADMIN_TOKEN_ENV = "FURLONG_ADMIN_TOKEN"
MIN_TOKEN_CHARS = 16


class Unauthorized(PermissionError):
    """HTTP 401: a control route called without the admin token."""


@dataclass(frozen=True)
class ControlPolicy:
    admin_token: str | None = None  # None: control routes are open (in process, trusted)
    weights_dir: Path | None = None  # None: any path this process can read

    def __post_init__(self) -> None:
        if self.admin_token is not None and len(self.admin_token) < MIN_TOKEN_CHARS:
            raise InputError(f"admin_token: use at least {MIN_TOKEN_CHARS} characters")
        if self.weights_dir is not None:
            resolved = Path(self.weights_dir).resolve()
            if not resolved.is_dir():
                raise InputError(f"weights_dir: {self.weights_dir} is not a directory")
            object.__setattr__(self, "weights_dir", resolved)

    def require_admin(self, headers: Any) -> None:
        """Raise :class:`Unauthorized` unless ``headers`` carry the admin token (a no-op when
        no token is configured)."""
        if self.admin_token is None:
            return
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.admin_token.encode()
        ):
            raise Unauthorized(
                "authorization: this route needs the server's admin token "
                "(Authorization: Bearer <token>)"
            )

    def load_weights(self, path: Any, field: str = "path") -> dict[str, torch.Tensor]:
        """The tensors of a safetensors file, or of every ``*.safetensors`` in a directory, at
        ``path``. Any failure (not allowed, missing, unreadable, not safetensors) is one
        :class:`InputError` that names ``field`` and says nothing about the file."""
        from safetensors.torch import load_file

        if not isinstance(path, str | os.PathLike) or not str(path):
            raise InputError(f"{field}: expected a safetensors file or directory, got {path!r}")
        refusal = InputError(
            f"{field}: no loadable safetensors weights at {str(path)!r}"
            + ("" if self.weights_dir is None else " inside the server's weights directory")
        )
        try:
            where = Path(path).resolve()
            if self.weights_dir is not None and not where.is_relative_to(self.weights_dir):
                raise PermissionError(f"{where} is outside {self.weights_dir}")
            files = sorted(where.glob("*.safetensors")) if where.is_dir() else [where]
            for f in files:  # a link inside the directory may point out of it
                if self.weights_dir is not None and not f.resolve().is_relative_to(
                    self.weights_dir
                ):
                    raise PermissionError(f"{f} resolves outside {self.weights_dir}")
            if not files:
                raise FileNotFoundError(f"{where}: no *.safetensors")
            return {k: v for f in files for k, v in load_file(str(f)).items()}
        except Exception as exc:  # safetensors raises its own types on bad bytes
            log.warning("%s: refused %r (%s: %s)", field, str(path), type(exc).__name__, exc)
            raise refusal from None


def admin_token_from(path: str | None) -> tuple[str, bool]:
    """The CLI's admin token: the file at ``path``, else ``$FURLONG_ADMIN_TOKEN``, else a new
    random one. Returns (token, generated) so that the caller can show a generated token."""
    if path is not None:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise InputError(f"--admin-token-file: cannot read {path} ({exc.strerror})") from None
        except UnicodeDecodeError:
            raise InputError(f"--admin-token-file: {path} is not text") from None
        if not token:
            raise InputError(f"--admin-token-file: {path} is empty")
        return _long_enough(token, f"--admin-token-file: the token in {path}"), False
    if token := os.environ.get(ADMIN_TOKEN_ENV, "").strip():
        return _long_enough(token, f"${ADMIN_TOKEN_ENV}"), False
    return secrets.token_urlsafe(32), True


def _long_enough(token: str, where: str) -> str:
    if len(token) < MIN_TOKEN_CHARS:  # ControlPolicy's rule, said in the flag's words
        raise InputError(f"{where} has {len(token)} characters; use at least {MIN_TOKEN_CHARS}")
    return token


def cli_policy(admin_token_file: str | None, weights_dir: str | None) -> tuple[ControlPolicy, bool]:
    """The policy of a server started from the command line, always with a token, and whether
    that token was generated (then the caller shows it once on stderr, since the trainer needs
    it to publish weights). Errors name the flags."""
    token, generated = admin_token_from(admin_token_file)
    if weights_dir is not None and not Path(weights_dir).is_dir():
        why = "is not a directory" if Path(weights_dir).exists() else "no such directory"
        raise InputError(f"--weights-dir: {weights_dir!r}: {why}")
    return ControlPolicy(token, Path(weights_dir) if weights_dir else None), generated
