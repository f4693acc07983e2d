"""The SIMD kernel sets torch can run under on this CPU, as the environment that selects each.

The same seed rounds differently under another kernel set (ATen's vectorised kernels, MKL's
GEMM code path, oneDNN's ISA), so a claim about learning is checked under several: a child
process started with ``environment(name)`` computes as a CPU of that class would.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

from furlong.precision import cpu_bf16_flags

# name -> the variables that cap ATen, MKL and oneDNN at that instruction set, weakest first
KERNEL_SETS: dict[str, dict[str, str]] = {
    "default": {  # no SIMD kernels in ATen; MKL and oneDNN at their SSE floor
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
    },
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
    },
    # native bf16 matmuls (oneDNN): AVX-512 BF16 dot products, then AMX tiles; under the sets
    # above bf16 GEMMs are emulated, so a bf16 model rounds differently under each of the five
    "avx512_bf16": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
    },
    "amx": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX",
    },
}
BF16_SETS = {"avx512_bf16": "avx512_bf16", "amx": "amx_bf16"}  # set -> the cpuinfo flag it needs


def environment(kernels: str, threads: int | None = None) -> dict[str, str]:
    """This process's environment with the ``kernels`` set (and ``threads`` intra-op threads)."""
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_SETS["default"]}
    env.update(KERNEL_SETS[kernels])
    if threads is not None:
        env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return env


@functools.cache
def best() -> str:
    """The strongest kernel set this CPU runs: what torch picks when nothing caps it."""
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_SETS["default"]}
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    found = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    return found.lower() if found.lower() in KERNEL_SETS else "default"


def available() -> list[str]:
    """Every kernel set this CPU can run, weakest first (``default`` always)."""
    names = [n for n in KERNEL_SETS if n not in BF16_SETS]
    found = names[: names.index(best()) + 1]
    if found[-1] == "avx512":
        flags = cpu_bf16_flags() or ()
        found += [name for name, flag in BF16_SETS.items() if flag in flags]
    return found
