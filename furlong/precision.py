"""Model precision: the names a user picks from, and what ``auto`` means on this machine.

bf16 halves the bytes of every weight and activation, and where the hardware has a native
bf16 matmul (a CUDA GPU of compute capability 8+, an x86 CPU with AMX or AVX-512 BF16) it
also runs the matmuls several times faster than fp32; on a CPU without one, torch emulates bf16
GEMMs far slower than fp32. So ``auto`` is bf16 where it is fast and fp32 elsewhere. Whatever
the model's precision, log-probs are computed in fp32 and the optimizer steps fp32 master
weights (``furlong.train.master_weights``). Torch-free: the CLI checks names before torch loads.
"""

from __future__ import annotations

import functools
from pathlib import Path

from furlong.errors import InputError

DTYPES = ("float32", "bfloat16", "auto")  # what model.dtype / --dtype accept
FAST_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of a native bf16 matmul


@functools.cache
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The instruction-set flags of this CPU's ``flags`` line; None where cpuinfo is
    unreadable."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    return frozenset(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())


def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, ...] | None:
    """This CPU's native bf16 matmul flags (empty: none); None where cpuinfo is unreadable."""
    flags = cpu_flags(cpuinfo)
    return None if flags is None else tuple(f for f in FAST_BF16_FLAGS if f in flags)


def fast_bf16(device: str = "cpu") -> bool:
    """Whether ``device`` runs bf16 matmuls natively (faster than fp32)."""
    if device.startswith("cuda"):
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return bool(cpu_bf16_flags())


def describe_bf16() -> str:
    """A line for benchmark output: whether this CPU has a native bf16 matmul path."""
    flags = cpu_bf16_flags()
    if flags is None:
        return "unknown (no /proc/cpuinfo)"
    if flags:
        return f"yes ({', '.join(flags)})"
    return f"no (neither {' nor '.join(FAST_BF16_FLAGS)}: bf16 matmuls are emulated)"


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """``float32`` or ``bfloat16`` for a name of :data:`DTYPES` (``auto``: bf16 where fast)."""
    if name not in DTYPES:
        raise InputError(f"dtype: {name!r} is not one of {', '.join(map(repr, DTYPES))}")
    if name == "auto":
        return "bfloat16" if fast_bf16(device) else "float32"
    return name
