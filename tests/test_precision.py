"""furlong.precision: which CPUs have a native bf16 matmul, and what ``auto`` resolves to."""

from __future__ import annotations

from pathlib import Path

import pytest

from furlong import precision
from furlong.errors import InputError
from furlong.rl.config import load_config

ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512bw\n"
SAPPHIRE = "flags\t\t: avx2 avx512f amx_bf16 amx_tile avx512_bf16\n"
HASWELL = "flags\t\t: fpu sse2 avx avx2 fma\n"


@pytest.mark.parametrize(
    ("cpuinfo", "flags"),
    [(ZEN4, ("avx512_bf16",)), (SAPPHIRE, ("amx_bf16", "avx512_bf16")), (HASWELL, ())],
)
def test_cpu_bf16_flags_read_cpuinfo(tmp_path: Path, cpuinfo: str, flags: tuple) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    assert precision.cpu_bf16_flags(str(path)) == flags


def test_unreadable_cpuinfo_is_unknown(tmp_path: Path) -> None:
    assert precision.cpu_bf16_flags(str(tmp_path / "missing")) is None


@pytest.mark.parametrize(("flags", "auto"), [(("amx_bf16",), "bfloat16"), ((), "float32")])
def test_auto_is_bf16_only_where_it_is_fast(monkeypatch, flags: tuple, auto: str) -> None:
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: flags)
    assert precision.resolve_dtype("auto") == auto
    assert precision.resolve_dtype("float32") == "float32"  # an explicit choice is kept
    assert precision.resolve_dtype("bfloat16") == "bfloat16"  # available without a fast path
    assert ("yes" if flags else "no") in precision.describe_bf16()


def test_bad_names_are_refused_by_field() -> None:
    with pytest.raises(InputError, match="dtype: 'half' is not one of"):
        precision.resolve_dtype("half")
    with pytest.raises(InputError, match="model.dtype"):
        load_config(None, ["model.dtype=half"])
    assert load_config(None, ["model.dtype=auto"]).model.dtype == "auto"
