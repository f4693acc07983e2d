"""Crash-safe file writes: after a crash, a kill or a power cut a reader finds the old file or
the whole new one, never a torn one. The one place furlong writes a file it must not lose.

    atomic_write_text(path, text)      # also atomic_write_bytes(path, data)
    with replacing(path) as tmp:       # for a writer that wants a path (a plot, a library)
        fig.savefig(tmp, format="png")

Each writes a temp file beside ``path`` (``.<name>.tmp-<8 hex>``, unique per writer, so
concurrent writers never share one), fsyncs it, ``os.replace``-s it over ``path`` and fsyncs the
directory so the rename itself survives a power cut. A failed write removes its temp file and
leaves ``path`` as it was.

Whole directories are published by ``furlong.models.loading`` (``atomic_dir`` / ``publish_dir``)
with ``fsync_tree`` and ``fsync_path`` from here.

Imports nothing of furlong: every package (train, rollout, rl, server, models) may use it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def temp_sibling(path: Path, kind: str = "tmp") -> Path:
    """``.<name>.<kind>-<8 hex>`` beside ``path``: hidden, and unique per call."""
    return path.parent / f".{path.name}.{kind}-{uuid.uuid4().hex[:8]}"


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's data, or a directory's entries (so a rename in it survives a power cut)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Every file and directory under ``root``, then ``root`` itself."""
    for path in root.rglob("*"):
        if path.is_file() or path.is_dir():
            fsync_path(path)
    fsync_path(root)


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """A temp path beside ``path`` to write; when the block ends it is fsynced and replaces
    ``path``, then the directory is fsynced. On an error the temp file goes, ``path`` stays."""
    final = Path(path)
    tmp = temp_sibling(final)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(final.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """``path`` holds ``data``, or (after a crash) what it held before; created with the
    umask's permissions, like ``Path.write_bytes``."""
    with replacing(path) as tmp, open(tmp, "xb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode())
