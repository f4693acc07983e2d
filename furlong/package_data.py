"""The files furlong reads from its own package directory at run time, besides its modules.

Every such read goes through :func:`package_file`, which takes only a name listed in
:data:`FILES`: the list is complete by construction, pyproject.toml's package data ships it,
and ``tests/test_packaging.py`` builds the wheel and the sdist and checks each carries all of
it (an editable install would hide a file left out)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).parent
FILES = (
    "models/fused_ops.c",  # the inference kernels (furlong.models.fused_kernels)
    "models/fused_train_ops.c",  # the training kernels
    "models/fused_ops.h",  # what both include
)


def package_file(name: str) -> Path:
    """The installed path of ``name``, one of :data:`FILES` (relative to the package)."""
    if name not in FILES:
        raise ValueError(f"{name!r} is not in furlong.package_data.FILES; add it there")
    return ROOT / name
