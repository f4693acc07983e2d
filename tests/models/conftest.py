"""What the fused-kernel tests share."""

from __future__ import annotations

import shutil

import pytest

from furlong.models import fused_kernels as fk


@pytest.fixture
def kernels() -> fk.FusedKernels:
    """The compiled fused CPU kernels: skipped without a C compiler on PATH, and where there is
    one they must build."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    k = fk.fused_kernels()
    assert k is not None, "a C compiler is on PATH, so the kernels must build"
    return k
