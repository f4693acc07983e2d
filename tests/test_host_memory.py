"""keep_freed_blocks: activation-sized blocks come from the heap and stay there once freed,
on the main thread and on a thread started after it, blocks above glibc's 32 MiB mmap
threshold included.

glibc's default maps each large block afresh (``mmap``) until its adaptive threshold catches
up, trims the heap top whenever more than twice that threshold is free, and gives a new
thread its own arena, whose heaps cap at 64 MiB: a training step that frees its activations
pays page faults for them again at the next step. Where a block
lives is read from ``/proc/self/maps`` (deterministic, unlike fault counts, which this VM's
memory reclaim also moves)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from furlong import host_memory

PROBE = """
import json, sys, threading, torch
from furlong import host_memory
applied = host_memory.keep_freed_blocks() if sys.argv[1] == "keep" else True
def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            return start, end
held = [torch.ones(5 << 20) for _ in range(4)]  # 4 x 20 MiB activations
start, end = heap()
in_heap = [start <= t.data_ptr() < end for t in held]
del held
kept = heap()[1] >= end
# 400 MiB (never touched): above the mmap threshold, the heap's free top and its top pad
main = torch.empty(100 << 20)
start, end = heap()
big_main = start <= main.data_ptr() < end
worker = []  # a compute thread's (above 64 MiB, too, a thread arena's largest heap)
thread = threading.Thread(target=lambda: worker.append(torch.empty(100 << 20)))
thread.start()
thread.join()
start, end = heap()
big = start <= worker[0].data_ptr() < end
out = {"applied": applied, "in_heap": in_heap, "kept": kept, "big_main": big_main, "big": big}
print(json.dumps(out))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_blocks_come_from_the_heap_and_stay_there() -> None:
    libc = host_memory._libc()
    if libc is None or not hasattr(libc, "mallopt") or not Path("/proc/self/maps").is_file():
        pytest.skip("needs glibc and /proc")
    default, keep = _probe("default"), _probe("keep")
    assert default["in_heap"] == [False] * 4  # mapped one by one
    assert not default["big_main"] and not default["big"]
    assert keep["applied"] and keep["in_heap"] == [True] * 4
    assert keep["kept"]  # freeing 80 MiB did not shrink the heap
    assert keep["big_main"] and keep["big"]  # 400 MiB blocks too, a worker thread's as well


def test_release_host_memory_runs() -> None:
    host_memory.release_host_memory()  # gc + malloc_trim where glibc has it; never raises
