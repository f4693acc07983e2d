"""furlong.atomic: a write leaves the old file or the whole new one, and no temp file."""

from __future__ import annotations

import errno
import os

import pytest

from furlong.atomic import atomic_write_bytes, atomic_write_text, replacing


def test_writes_and_replaces_leaving_no_temp_file(tmp_path) -> None:
    path = tmp_path / "state.json"
    atomic_write_text(path, "old")
    atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["state.json"]


def test_permissions_follow_the_umask(tmp_path) -> None:
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o644


def test_a_failed_write_keeps_the_old_file(tmp_path) -> None:
    path = tmp_path / "curves.png"
    atomic_write_text(path, "old")
    with pytest.raises(OSError), replacing(path) as tmp:
        tmp.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["curves.png"]
