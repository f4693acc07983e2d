"""The host heap (glibc malloc) under PyTorch's CPU tensors, which have no caching allocator.

By default glibc serves a block above its mmap threshold (128 KiB, raised adaptively up to
32 MiB) with a fresh ``mmap`` and unmaps it on free, so a training step that allocates the
same activation tensors every time page-faults and zeroes them every time (~20k faults per
step of the RL benchmark's training pass). :func:`keep_freed_blocks` makes the heap behave
like a caching allocator for the life of a long run; :func:`release_host_memory` hands free
pages back when a caller knows a peak is over (e.g. after a failed oversized request).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to 32 MiB come from the heap
TRIM_THRESHOLD = 1 << 30  # free memory kept at the top of the heap before trimming
TOP_PAD = 256 << 20  # grow the heap in large steps


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name is not None else None


def keep_freed_blocks() -> bool:
    """Serve blocks up to 32 MiB from the heap and keep up to 1 GiB of freed heap for reuse
    (process-wide, until exit). False where the C library is not glibc (nothing changes)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return all(libc.mallopt(k, v) == 1 for k, v in (*settings, (M_TOP_PAD, TOP_PAD)))


def release_host_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc keeps them otherwise,
    so one failed large request would pin its peak memory for the life of the server)."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
