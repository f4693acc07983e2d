"""File-backed tensors for optimizer state: unlinked, fully reserved, MAP_SHARED files.

An allocation (:class:`FileAllocator`):

1. creates a temp file in this process's directory
   ``<disk_dir>/optimizer_state/rank<NNNNN>-<host>-<pid>-<start>`` (set up once per process;
   stale directories of dead processes on this host are purged then; removed, with
   ``optimizer_state`` if nothing else is in it, when the process exits cleanly);
2. reserves its blocks with ``posix_fallocate`` (``ftruncate`` only where the filesystem
   cannot), so a full disk fails here with ENOSPC, never later with SIGBUS on first touch;
3. maps it MAP_SHARED, 4. unlinks it (the space shows in ``df``, not in ``du``), 5. marks the
   storage, so adopting a marked tensor (or any view of it) is a no-op, and counts its bytes.

:func:`sync` msyncs the mappings behind a set of tensors (before a checkpoint is written, so
dirty-page writeback leaves the checkpoint's own fsync) and counts the flushed bytes.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import logging
import math
import mmap
import os
import re
import shutil
import socket
import tempfile
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from furlong.errors import InputError

log = logging.getLogger(__name__)

STATE_SUBDIR = "optimizer_state"
MOUNTS = "/proc/mounts"
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
_MS_SYNC = 4  # <sys/mman.h> on Linux; Python's mmap module does not export it
_MARK = "_furlong_file_backed"
_DIR_NAME = re.compile(r"^rank\d{5}-(?P<host>.+)-(?P<pid>\d+)-(?P<start>\d+)$")
_ready_dirs: dict[tuple[str, int], Path] = {}  # (disk_dir, pid) -> this process's directory


# ---------------------------------------------------------------- directories


def filesystem_type(path: str | os.PathLike) -> str:
    """The type of the filesystem holding ``path`` (or its nearest existing ancestor)."""
    target = Path(path).absolute()
    while not target.exists():
        target = target.parent
    target = target.resolve()
    best, kind = "", "unknown"
    with open(MOUNTS) as f:
        for line in f:
            fields = line.split()
            if len(fields) < 3:
                continue
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
            inside = target == Path(point) or Path(point) in target.parents
            if inside and len(point) >= len(best):  # the last mount over a point wins
                best, kind = point, fields[2]
    return kind


def check_disk_dir(disk_dir: str | os.PathLike) -> None:
    kind = filesystem_type(disk_dir)
    if kind in MEMORY_FILESYSTEMS:
        raise InputError(
            f"optimizer.disk_dir: {disk_dir} is on {kind}, which is memory: file-backed "
            "optimizer state would never leave RAM; use a directory on a real disk"
        )


def _start_time(pid: int) -> int | None:
    """Kernel start time of ``pid`` (tells a live process from one that reused its pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after "pid (comm) state"


def purge_stale(root: Path) -> list[Path]:
    """Remove this host's process directories whose process is gone."""
    host, removed = socket.gethostname(), []
    for entry in root.iterdir() if root.is_dir() else ():
        m = _DIR_NAME.match(entry.name)
        if m is None or m["host"] != host:
            continue  # not ours to judge: another host sharing the disk
        if _start_time(int(m["pid"])) != int(m["start"]):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def process_dir(disk_dir: str | os.PathLike) -> Path:
    """This process's state directory under ``disk_dir``, set up once per process (checked
    not to be tmpfs, stale directories purged). Idempotent."""
    key = (str(Path(disk_dir).absolute()), os.getpid())
    if key in _ready_dirs:
        return _ready_dirs[key]
    check_disk_dir(disk_dir)
    root = Path(disk_dir) / STATE_SUBDIR
    root.mkdir(parents=True, exist_ok=True)
    for stale in purge_stale(root):
        log.info("optimizer state: removed stale directory %s", stale)
    pid = os.getpid()
    rank = int(os.environ.get("RANK", "0"))
    name = f"rank{rank:05d}-{socket.gethostname()}-{pid}-{_start_time(pid)}"
    path = root / name
    path.mkdir(exist_ok=False)  # unique per process: an existing one is another's (or a bug)
    _ready_dirs[key] = path
    atexit.register(_remove_if_empty, path, pid)
    return path


def _remove_if_empty(path: Path, pid: int) -> None:
    """At exit: the process directory (its files are unlinked as they are mapped, so it is
    empty unless an allocation was cut short) and ``optimizer_state`` if no other process's
    directory is left in it. Never in a forked child: the directory is its parent's."""
    if os.getpid() != pid:
        return
    for directory in (path, path.parent):
        with contextlib.suppress(OSError):  # not empty, or already gone
            directory.rmdir()


# ---------------------------------------------------------------- file-backed tensors


@dataclass
class _Mapping:
    """Attached to a mapped storage: its size and the allocator that counts it."""

    nbytes: int
    allocator: weakref.ref


def is_file_backed(t: torch.Tensor) -> bool:
    """True for a tensor (or any view of one) made by a :class:`FileAllocator`."""
    return t.device.type == "cpu" and hasattr(t.untyped_storage(), _MARK)


class FileAllocator:
    """Tensors in unlinked, fully reserved, MAP_SHARED files of one directory."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.allocated_bytes = 0  # everything ever mapped by this allocator
        self.flushed_bytes = 0  # everything msynced (per checkpoint, per mapping)
        self.msync_calls = 0

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)  # nothing to map
        fd, path = tempfile.mkstemp(dir=self.directory, prefix="state-")
        try:
            _reserve(fd, nbytes, self.directory)
            os.close(fd)
            fd = -1
            flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)  # MAP_SHARED
        finally:
            if fd >= 0:
                os.close(fd)
            os.unlink(path)  # the mapping keeps the blocks; df counts them, du does not
        storage = flat.untyped_storage()
        setattr(storage, _MARK, _Mapping(nbytes, weakref.ref(self)))
        self.allocated_bytes += nbytes
        return flat.view(tuple(shape))

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in a mapping: a marked tensor comes back unchanged (no copy, no new file)."""
        if is_file_backed(t):
            return t
        out = self.empty(t.shape, t.dtype)
        out.copy_(t)
        return out


def _reserve(fd: int, nbytes: int, directory: Path) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        assert e.errno is not None  # posix_fallocate's errors always carry one
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            raise OSError(
                e.errno,
                f"optimizer state: cannot reserve {nbytes} bytes in {directory} "
                f"({os.strerror(e.errno)}); free space or choose another optimizer.disk_dir",
            ) from e
        # the filesystem cannot reserve: size it sparsely (a full disk would then SIGBUS)
        os.ftruncate(fd, nbytes)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _msync(address: int, nbytes: int) -> None:
    if _libc.msync(address, nbytes, _MS_SYNC) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"optimizer state: msync failed: {os.strerror(err)}")


def sync(tensors: Iterable[torch.Tensor]) -> int:
    """msync(MS_SYNC) the mapping of every file-backed tensor (each mapping once); returns the
    bytes flushed. Raises OSError on failure."""
    seen: set[int] = set()
    flushed = 0
    for t in tensors:
        if not is_file_backed(t):
            continue
        storage = t.untyped_storage()
        address = storage.data_ptr()
        if address in seen:
            continue
        seen.add(address)
        mapping: _Mapping = getattr(storage, _MARK)
        assert address % mmap.PAGESIZE == 0  # the storage is the whole mapping
        _msync(address, mapping.nbytes)
        flushed += mapping.nbytes
        allocator = mapping.allocator()
        if allocator is not None:
            allocator.flushed_bytes += mapping.nbytes
            allocator.msync_calls += 1
    if flushed:
        log.info("optimizer state: msync flushed %d bytes before the checkpoint", flushed)
    return flushed
