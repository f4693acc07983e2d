"""What a `furlong train` command line says before it is a config: the TOML file's tables with
the ``group.field=value`` overrides laid over them, as plain values. Torch-free, so the CLI can
check the model name in it before importing the RL stack (:mod:`furlong.rl.config` types and
validates it)."""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from furlong.errors import InputError
from furlong.models.names import check_model


def raw_config(path: str | Path | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The file's tables (none without a file), then each override in order (the last wins)."""
    raw = {} if path is None else read_toml(path)
    for i, item in enumerate(overrides):
        key, sep, value = item.partition("=")
        group, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise InputError(f"overrides[{i}]: {item!r} is not group.field=value")
        table, dot, entry = name.partition(".")  # group.table.entry=value: one key of a table
        if not dot:
            raw.setdefault(group, {})[name] = _literal(value.strip())
            continue
        inner = raw.setdefault(group, {}).setdefault(table, {})
        if not isinstance(inner, dict):
            raise InputError(f"overrides[{i}]: {group}.{table} is not a table")
        inner[entry] = _literal(value.strip())
    return raw


def check_model_name(name: object) -> None:
    """``model.name`` names a model furlong can load (furlong.models.names), checked before any
    weights or framework load: offline, a typo fails at once with the closest name."""
    if isinstance(name, str):  # else the typed config refuses the value's type
        check_model(name, "model.name", "set model.name=tiny-qwen3 or a local HF dir")


def read_toml(path: str | Path) -> dict[str, Any]:
    """A config file's tables; a missing or malformed file is the user's error, named."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise InputError(f"config file {str(path)!r}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"config file {str(path)!r}: is a directory, not a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"config file {str(path)!r}: not valid TOML ({e})") from None


def _literal(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word: a string
