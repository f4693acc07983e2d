"""Sampler-snapshot archives: the tar that ``RestClient.get_checkpoint_archive_url`` of SDKs up
to 0.37 points at (tinker-cookbook's ``weights.download`` of a ``sampler_weights/`` path
fetches it and extracts it safely). SDK 0.38 no longer has that method.

The archive holds the snapshot's files at its top level, as an HF directory: for a LoRA model
``adapter_config.json`` (naming the served base, like an HF export) and
``adapter_model.safetensors``, which is what the cookbook's ``build_hf_model`` /
``build_lora_adapter`` read from the extracted directory; for a full fine-tune the HF model
files. furlong's own snapshot metadata stays out. The tar is streamed as it is read, never
built on disk or in memory; its length is known before the first byte (``Content-Length``, so
a cut transfer is noticed). Every file is opened before streaming starts, through one handle on
the snapshot directory: a re-save that publishes a new snapshot meanwhile (files are never
changed in place) cannot mix two snapshots into one archive.
"""

from __future__ import annotations

import json
import os
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import BinaryIO

from furlong.server.external_weights import ADAPTER_CONFIG, name_base_model
from furlong.server.models import SNAPSHOT_META

ARCHIVE_FILE = "archive.tar"  # what download tokens are signed for (one signing rule)
CHUNK = 1 << 20
BLOCK = tarfile.BLOCKSIZE


@dataclass
class _Member:
    name: str
    file: BinaryIO
    size: int
    mtime: float

    def header(self) -> bytes:
        info = tarfile.TarInfo(self.name)
        info.size, info.mtime, info.mode = self.size, int(self.mtime), 0o644
        # PAX: names of any length and files over 8 GiB (a full fine-tune's shards)
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


class Archive:
    """A snapshot's open files as one tar stream: ``length`` bytes from ``chunks()``."""

    def __init__(self, members: list[_Member]):
        self._members = members
        self._headers = [m.header() for m in members]
        body = sum(
            len(h) + m.size + _padding(m.size) for h, m in zip(self._headers, members, strict=True)
        )
        self.length = body + 2 * BLOCK  # the end-of-archive marker: two zero blocks

    def chunks(self) -> Iterator[bytes]:
        try:
            for header, member in zip(self._headers, self._members, strict=True):
                yield header
                left = member.size
                while left:
                    chunk = member.file.read(min(CHUNK, left))
                    if not chunk:  # published files never shrink; end short, never pad lies
                        raise OSError(f"{member.name}: ended {left} bytes early")
                    left -= len(chunk)
                    yield chunk
                yield bytes(_padding(member.size))
            yield bytes(2 * BLOCK)
        finally:
            self.close()

    def close(self) -> None:
        for member in self._members:
            member.file.close()


def open_archive(path: Path) -> Archive:
    """Open every file of the snapshot at ``path`` (``FileNotFoundError`` if it went)."""
    members: list[_Member] = []
    try:
        meta: dict = {}
        for top, _dirs, names, dir_fd in os.fwalk(path, onerror=_raise):
            rel = Path(top).relative_to(path)
            for name in sorted(names):
                if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                    continue  # never a link, socket or device (and never block on a FIFO)
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
                file = os.fdopen(fd, "rb")
                info = os.fstat(fd)
                member = _Member((rel / name).as_posix(), file, info.st_size, info.st_mtime)
                if member.name == SNAPSHOT_META:
                    meta = json.loads(file.read())
                    file.close()
                    continue
                members.append(member)
        members.sort(key=lambda m: m.name)
        for i, member in enumerate(members):
            if member.name == ADAPTER_CONFIG and meta.get("base_model"):
                config = name_base_model(member.file.read(), meta["base_model"])
                member.file.close()
                members[i] = _Member(member.name, BytesIO(config), len(config), member.mtime)
    except BaseException:
        for member in members:
            member.file.close()
        raise
    return Archive(members)


def _raise(exc: OSError) -> None:
    raise exc  # os.fwalk skips what it cannot open: a vanished snapshot is not an empty one


def _padding(size: int) -> int:
    return -size % BLOCK
