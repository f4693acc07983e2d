"""The host heap (glibc malloc) under PyTorch's CPU tensors, which have no caching allocator.

By default glibc serves a block above its mmap threshold (128 KiB, raised adaptively up to
32 MiB) with a fresh ``mmap`` and unmaps it on free, and a thread other than the main one
allocates from its own arena, whose heaps hold at most 64 MiB, so its larger blocks are
always mapped afresh. A training step that allocates the same activation tensors every time
then page-faults and zeroes them every time: ~20k faults per step of the RL benchmark's
128 x 52 training pass, and 1.36M (5.6 GB of fresh pages) per 64 x 512 step of small-qwen3
in fp32 on a worker thread, 29% of its time (``benchmarks/host_heap.py``).
:func:`keep_freed_blocks` makes the heap behave like a caching allocator for the life of a
long run; :func:`release_host_memory` hands free pages back when a caller knows a peak is over
(e.g. after a failed oversized request).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -2, -3, -4, -8
MMAP_THRESHOLD = 32 << 20  # glibc's largest (fixed, no longer adaptive)
MMAP_MAX = 0  # no block is mapped on its own: the largest come from the heap too
ARENA_MAX = 1  # threads created later share the main arena, whose heap has no size cap
TRIM_THRESHOLD = -1  # never trim the heap top: a step keeps its pages for the next
TOP_PAD = 256 << 20  # grow the heap in large steps


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name is not None else None


def keep_freed_blocks() -> bool:
    """Serve every block from the heap, for threads started from now on too, and keep freed
    heap for reuse (process-wide, until exit; :func:`release_host_memory` still trims): the
    next step's activations reuse the last step's pages. Resident memory stays at the run's
    high-water mark, as a caching allocator's pool does (a peak of 3.8-3.9 GB against 3.3 GB
    for that step). Call it before the threads that compute start (a thread keeps the arena
    it has). False where the C library is not glibc (nothing changes)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    settings = (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (M_MMAP_MAX, MMAP_MAX),
        (M_ARENA_MAX, ARENA_MAX),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_TOP_PAD, TOP_PAD),
    )
    return all(libc.mallopt(k, v) == 1 for k, v in settings)


def release_host_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc keeps them otherwise,
    so one failed large request would pin its peak memory for the life of the server)."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
