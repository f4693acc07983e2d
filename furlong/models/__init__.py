"""Offline models: seeded tiny presets, a locally trained tokenizer, and one loader for
preset names, local HF directories and hub ids.

The loaders are imported on first use (PEP 562), so that `furlong.models.presets` and
`furlong.models.pretrained` stay importable without torch (the CLI's start-up)."""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "PRESETS": "furlong.models.presets",
    "build_preset": "furlong.models.presets",
    "load_model": "furlong.models.loading",
    "load_tokenizer": "furlong.models.loading",
    "save_hf_dir": "furlong.models.loading",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
