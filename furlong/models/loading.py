"""One loader for every place that takes a model: a preset name, a local HF directory, or a
hub id (the last only where a network exists)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from furlong.errors import InputError
from furlong.models.presets import PRESETS, build_preset


def _describe(spec: str) -> str:
    return (
        f"model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}), "
        "a local HF directory, nor a reachable hub id"
    )


def load_model(
    spec: str | os.PathLike, *, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[PreTrainedModel, Any]:
    """``(model, tokenizer)`` for a preset name, a local HF directory or a hub id."""
    spec = str(spec)
    if not spec.strip():
        raise InputError("model: empty name; give a preset, a local HF directory or a hub id")
    if spec in PRESETS:
        model, tokenizer = build_preset(spec, seed=seed)
        return model.to(dtype), tokenizer
    if Path(spec).is_dir() and not (Path(spec) / "config.json").exists():
        raise InputError(f"model {spec!r}: directory has no config.json (not an HF model dir)")
    try:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise InputError(f"{_describe(spec)} ({exc})") from None
    return model, load_tokenizer(spec)


def load_tokenizer(spec: str | os.PathLike) -> Any:
    """The tokenizer of a preset, local HF directory or hub id; refuses an unusable one."""
    spec = str(spec)
    if spec in PRESETS:
        return build_preset(spec)[1]
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as exc:
        raise InputError(f"tokenizer of {spec!r} cannot be loaded ({exc})") from None
    # transformers 5 falls back to an empty tokenizer when the files are missing.
    if len(tokenizer) <= 1:
        raise InputError(f"tokenizer of {spec!r}: no tokenizer files found (vocabulary is empty)")
    return tokenizer


def atomic_dir(out: str | os.PathLike) -> tuple[Path, Path]:
    """``(tmp, final)``: write into ``tmp``, then ``publish_dir(tmp, final)``."""
    final = Path(out)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp, final


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_dir(tmp: Path, final: Path) -> None:
    """Swap ``tmp`` into ``final`` with renames, so readers never see a half-written dir.

    The files are fsynced first: after a crash the directory is either the old one or the
    complete new one."""
    _fsync_tree(tmp)
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        final.rename(old)
    tmp.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_hf_dir(model: PreTrainedModel, tokenizer: Any, out: str | os.PathLike) -> Path:
    """Write a normal HF directory (config.json, safetensors, tokenizer files) atomically."""
    tmp, final = atomic_dir(out)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, final)
    return final
