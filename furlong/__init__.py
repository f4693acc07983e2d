"""furlong: reinforcement-learning post-training of language models."""

from __future__ import annotations

from typing import Any

from furlong.errors import InputError

__all__ = ["AdamParams", "Datum", "ForwardResult", "InputError"]
__version__ = "0.1.0"
_TYPES = frozenset({"AdamParams", "Datum", "ForwardResult"})


def __getattr__(name: str) -> Any:
    # furlong.types needs torch: imported on first use, so `furlong --help` does not pay for it
    if name in _TYPES:
        from furlong import types

        return getattr(types, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
