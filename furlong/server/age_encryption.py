"""age encryption of HF exports: ``save_weights_external(..., age_encryption_recipients=[...])``.

tinker-cookbook's ``weights.download`` of a ``weights/`` path exports the checkpoint encrypted
to a key it generates for that download, fetches each ``<file>.age`` and decrypts it with
``pyrage`` (bindings to rage, the Rust age implementation), so the same library encrypts
here. Recipients are native ``age1...`` X25519 keys or SSH public keys (``ssh-ed25519`` /
``ssh-rsa``), at most 10, as the SDK documents; every file is encrypted to all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyrage

from furlong.errors import InputError

MAX_RECIPIENTS = 10  # the SDK's documented limit
SUFFIX = ".age"
FIELD = "age_encryption_recipients"

# pyrage is an extension module without type information: a recipient is an opaque object
Recipient = Any


def parse_recipients(values: Sequence[str] | None) -> list[Recipient]:
    """The recipients of a request (``[]``: no encryption), each checked before anything is
    queued, so a bad one is a 400 naming its index."""
    if not values:
        return []
    if len(values) > MAX_RECIPIENTS:
        raise InputError(f"{FIELD}: at most {MAX_RECIPIENTS} recipients, got {len(values)}")
    return [_parse(value, f"{FIELD}[{i}]") for i, value in enumerate(values)]


def _parse(value: str, where: str) -> Recipient:
    text = value.strip()  # a key read from a file keeps its newline
    shown = text if len(text) <= 80 else text[:77] + "..."  # public keys: safe to echo
    if text.startswith("age1"):
        try:
            return pyrage.x25519.Recipient.from_str(text)
        except pyrage.RecipientError as exc:
            raise InputError(
                f"{where}: {shown!r} is not a valid age X25519 public key ({exc})"
            ) from None
    try:
        return pyrage.ssh.Recipient.from_str(text)
    except pyrage.RecipientError:
        raise InputError(
            f"{where}: {shown!r} is neither an age X25519 public key ('age1...') nor an SSH "
            "public key ('ssh-ed25519 ...' or 'ssh-rsa ...')"
        ) from None


def encrypt_files(root: Path, names: Sequence[str], recipients: Sequence[Recipient]) -> None:
    """Replace each ``root/<name>`` by ``root/<name>.age``, encrypted to every recipient.

    Streams file to file (``encrypt_io`` reads and writes through the open files in small
    chunks, so memory stays flat whatever the file's size, and the file reads release the GIL,
    so the server's other threads keep running). Call it on a directory that is not yet
    published (``atomic_dir``): a failure leaves only the temp directory, never a half-
    encrypted export."""
    for name in names:
        plain = root / name
        with open(plain, "rb") as src, open(plain.with_name(plain.name + SUFFIX), "wb") as dst:
            pyrage.encrypt_io(src, dst, list(recipients))
        plain.unlink()
