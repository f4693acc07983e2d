"""One loader for every place that takes a model: a preset name, a pretrained name (built once
into the cache), a local HF directory, or a hub id (the last only where a network exists)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from furlong.atomic import fsync_path, fsync_tree, temp_sibling
from furlong.errors import InputError
from furlong.models.names import check_model, describe
from furlong.models.presets import PRESETS, build_preset
from furlong.models.pretrained import PRETRAINED, pretrained_dir


def _describe(spec: str) -> str:
    """Why from_pretrained failed, in the words of the start-up check (furlong.models.names)."""
    if Path(spec).is_dir():
        return f"model {spec!r}: the HF directory does not load"
    return f"model {spec!r} is {describe()}, and the hub cannot provide it"


def resolve(spec: str | os.PathLike) -> str:
    """A pretrained name as its cached HF directory (built on first use); anything else as is."""
    spec = str(spec)
    return str(pretrained_dir(spec)) if spec in PRETRAINED else spec


def load_model(
    spec: str | os.PathLike, *, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[PreTrainedModel, Any]:
    """``(model, tokenizer)`` for a model name, a local HF directory or a hub id."""
    spec = str(spec)
    if spec in PRESETS:
        model, tokenizer = build_preset(spec, seed=seed)
        # in place (Module.to returns self). transformers wraps PreTrainedModel.to with
        # functools.wraps(nn.Module.to), which typeshed types as the unbound function: self first
        model.to(dtype)  # type: ignore[arg-type]
        return model, tokenizer
    check_model(spec, "model")  # offline, an unknown name fails here, not after hub retries
    spec = resolve(spec)
    try:
        with no_hf_bars():  # callers report loading in their own words (or stay quiet)
            model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise InputError(f"{_describe(spec)} ({exc})") from None
    return model, load_tokenizer(spec)


def load_tokenizer(spec: str | os.PathLike) -> Any:
    """The tokenizer of a model name, local HF directory or hub id; refuses an unusable one."""
    spec = str(spec)
    if spec in PRESETS:
        return build_preset(spec)[1]
    if not Path(spec).is_dir():  # a directory may hold a tokenizer without a config.json
        check_model(spec, "model")
    spec = resolve(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as exc:
        raise InputError(f"tokenizer of {spec!r} cannot be loaded ({exc})") from None
    # transformers 5 falls back to an empty tokenizer when the files are missing.
    if len(tokenizer) <= 1:
        raise InputError(f"tokenizer of {spec!r}: no tokenizer files found (vocabulary is empty)")
    return tokenizer


# What publish_dir leaves beside ``<name>``: ``.<name>.tmp-<8 hex>`` (being written, or the old
# copy swapped out) and ``.<name>.old-<8 hex>`` (the old copy parked by the two-rename fallback).
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-[0-9a-f]{8}")
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


def atomic_dir(out: str | os.PathLike) -> tuple[Path, Path]:
    """``(tmp, final)``: write into ``tmp``, then ``publish_dir(tmp, final)``."""
    final = Path(out)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(final, "tmp")
    tmp.mkdir()
    return tmp, final


def publish_dir(tmp: Path, final: Path) -> None:
    """Put the complete directory ``tmp`` at ``final``; after a crash at any point ``final`` is
    the old or the new copy (or, on the fallback path, ``recover_published`` makes it so).

    Overwrite swaps the two with one ``renameat2(RENAME_EXCHANGE)``; where the kernel, libc or
    filesystem lacks it, two renames with the old copy parked at ``.<name>.old-*``."""
    fsync_tree(tmp)  # the contents reach the disk before any name points at them
    if _rename_new(tmp, final):
        return
    if _exchange(tmp, final):
        fsync_path(final.parent)
        shutil.rmtree(tmp, ignore_errors=True)  # the old copy, now at the temp name
    else:
        _replace_in_two_steps(tmp, final)


def remove_dir(final: Path) -> None:
    """Delete a published directory: renamed to a temp name first, so a crash mid-delete never
    leaves a half-deleted copy under its real name (``recover_published`` purges the rest)."""
    doomed = temp_sibling(final, "tmp")
    final.rename(doomed)
    fsync_path(final.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def recover_published(root: str | os.PathLike) -> list[Path]:
    """Undo what a crash mid-``publish_dir`` left anywhere under ``root``: where ``final`` is
    missing its parked ``.<final>.old-*`` copy moves back, and every other ``.<name>.tmp-*`` /
    ``.<name>.old-*`` directory is removed. Returns the restored directories.

    Only call it while nothing publishes under ``root`` (at start-up): a live writer's temp
    directory looks the same as a dead one's."""
    restored: list[Path] = []
    pending = [Path(root)]
    while pending:
        parent = pending.pop()
        subdirs = [e for e in _scandir(parent) if e.is_dir(follow_symlinks=False)]
        leftovers = [Path(e.path) for e in subdirs if _LEFTOVER.fullmatch(e.name)]
        back = _recover_siblings(parent, leftovers)
        restored += back
        pending += back + [Path(e.path) for e in subdirs if not _LEFTOVER.fullmatch(e.name)]
    return restored


def _rename_new(tmp: Path, final: Path) -> bool:
    """First publish: a plain rename. False when ``final`` exists (also if it just appeared)."""
    if os.path.lexists(final):
        return False
    try:
        tmp.rename(final)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    fsync_path(final.parent)
    return True


def _replace_in_two_steps(tmp: Path, final: Path) -> None:
    """Without RENAME_EXCHANGE: a crash between the renames leaves ``final`` missing and the
    acknowledged copy at ``.<name>.old-*``, where ``recover_published`` finds it."""
    old = temp_sibling(final, "old")
    final.rename(old)
    fsync_path(final.parent)
    tmp.rename(final)
    old.rename(tmp)  # a partly deleted copy must never carry the name recovery restores
    fsync_path(final.parent)
    shutil.rmtree(tmp, ignore_errors=True)


def _load_renameat2() -> Any:
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_LIBC_RENAMEAT2 = _load_renameat2()


def _renameat2(src: Path, dst: Path, flags: int) -> int:
    """0, or the errno of ``renameat2`` (ENOSYS where libc has none)."""
    if _LIBC_RENAMEAT2 is None:
        return errno.ENOSYS
    if _LIBC_RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return 0
    return ctypes.get_errno()


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step; False where the kernel, libc or fs cannot."""
    err = _renameat2(a, b, _RENAME_EXCHANGE)
    if err in _UNSUPPORTED:
        return False
    if err:
        raise OSError(err, os.strerror(err), str(a), None, str(b))
    return True


def _recover_siblings(parent: Path, leftovers: list[Path]) -> list[Path]:
    parked: dict[str, list[Path]] = {}
    for path in leftovers:
        match = _LEFTOVER.fullmatch(path.name)
        if match and match["kind"] == "old":
            parked.setdefault(match["name"], []).append(path)
    restored = []
    for name, copies in parked.items():
        final = parent / name
        if not os.path.lexists(final):
            # one crash parks one copy; if several, the last parked (rename sets ctime)
            max(copies, key=lambda p: p.stat().st_ctime_ns).rename(final)
            restored.append(final)
    if restored:
        fsync_path(parent)
    for path in leftovers:
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)
    return restored


def _scandir(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except (FileNotFoundError, NotADirectoryError):
        return []


@contextlib.contextmanager
def no_hf_bars() -> Iterator[None]:
    """transformers' progress bars ("Writing model shards") off for the block: a save takes
    seconds and callers report it in their own words. What was set before is restored."""
    from huggingface_hub import utils as hub
    from transformers.utils import logging as hf_logging

    if not hf_logging.is_progress_bar_enabled():
        yield
        return
    hub_bars = not hub.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # the hub's bars too: it sets both
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()
        if not hub_bars:
            hub.disable_progress_bars()


def save_hf_dir(model: PreTrainedModel, tokenizer: Any, out: str | os.PathLike) -> Path:
    """Write a normal HF directory (config.json, safetensors, tokenizer files) atomically."""
    tmp, final = atomic_dir(out)
    try:
        with no_hf_bars():
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, final)
    return final
