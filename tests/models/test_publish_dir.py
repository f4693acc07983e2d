"""publish_dir: an overwrite leaves the old or the new copy at every point (one RENAME_EXCHANGE
swap, or two renames plus start-up recovery), and recover_published restores a copy parked by a
crash and purges leftover temp dirs, also after a real SIGKILL."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from furlong.models import loading
from furlong.models.loading import atomic_dir, publish_dir, recover_published

OLD = {"model.safetensors": b"old weights " * 500, "sub/meta.json": b'{"step": 1}'}
NEW = {"model.safetensors": b"new weights " * 700, "extra.bin": b"\x00\x01new"}


class Crash(BaseException):
    """The process dies here: nothing after it runs, not even ``except Exception``."""


def write(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def contents(root: Path) -> dict[str, bytes] | None:
    """Every file's bytes by relative path; None when ``root`` is missing."""
    if not root.is_dir():
        return None
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def publish(final: Path, files: dict[str, bytes]) -> None:
    tmp, final = atomic_dir(final)
    write(tmp, files)
    publish_dir(tmp, final)


def entries(parent: Path) -> list[str]:
    return sorted(os.listdir(parent))


def exchange_works(tmp_path: Path) -> bool:
    a, b = tmp_path / "probe-a", tmp_path / "probe-b"
    a.mkdir(), b.mkdir()
    ok = loading._renameat2(a, b, loading._RENAME_EXCHANGE) == 0
    a.rmdir(), b.rmdir()
    return ok


def no_exchange(monkeypatch: pytest.MonkeyPatch, err: int = errno.ENOSYS) -> None:
    monkeypatch.setattr(loading, "_renameat2", lambda src, dst, flags: err)


def die_before(monkeypatch: pytest.MonkeyPatch, step: int, ops: list[tuple[object, str]]) -> None:
    """Raise Crash instead of the ``step``-th call (from 0) to any of ``ops``."""
    calls = [0]

    def wrap(orig: Callable) -> Callable:
        def op(*args, **kwargs):
            calls[0] += 1
            if calls[0] - 1 == step:
                raise Crash
            return orig(*args, **kwargs)

        return op

    for owner, name in ops:
        monkeypatch.setattr(owner, name, wrap(getattr(owner, name)))


def test_first_publish_is_a_plain_rename(tmp_path):
    publish(tmp_path / "ckpt", NEW)
    assert contents(tmp_path / "ckpt") == NEW
    assert entries(tmp_path) == ["ckpt"]


def test_exchange_swaps_in_one_step(tmp_path, monkeypatch):
    """Between any two filesystem calls of the overwrite, ``final`` holds a complete copy."""
    if not exchange_works(tmp_path):
        pytest.skip("renameat2(RENAME_EXCHANGE) is unavailable here")
    final = tmp_path / "ckpt"
    publish(final, OLD)
    seen: list[dict[str, bytes] | None] = []
    swaps: list[bool] = []

    def observe(orig: Callable) -> Callable:
        def op(*args, **kwargs):
            out = orig(*args, **kwargs)
            seen.append(contents(final))
            return out

        return op

    for owner, name in [(os, "fsync"), (os, "rename"), (Path, "rename"), (shutil, "rmtree")]:
        monkeypatch.setattr(owner, name, observe(getattr(owner, name)))
    real_exchange = observe(loading._exchange)

    def exchange(a: Path, b: Path) -> bool:
        swaps.append(real_exchange(a, b))
        return swaps[-1]

    monkeypatch.setattr(loading, "_exchange", exchange)
    tmp, _ = atomic_dir(final)
    write(tmp, NEW)
    publish_dir(tmp, final)
    assert seen and all(s in (OLD, NEW) for s in seen)
    assert swaps == [True]  # the one-step path ran
    assert seen[-1] == NEW and contents(final) == NEW
    assert entries(tmp_path) == ["ckpt"]  # the old copy is gone


@pytest.mark.parametrize("err", [errno.ENOSYS, errno.EINVAL])
def test_falls_back_to_two_renames(tmp_path, monkeypatch, err):
    final = tmp_path / "ckpt"
    publish(final, OLD)
    no_exchange(monkeypatch, err)
    publish(final, NEW)
    assert contents(final) == NEW
    assert entries(tmp_path) == ["ckpt"]


def test_other_exchange_errors_raise_and_keep_the_old_copy(tmp_path, monkeypatch):
    final = tmp_path / "ckpt"
    publish(final, OLD)
    no_exchange(monkeypatch, errno.EACCES)
    with pytest.raises(PermissionError):
        publish(final, NEW)
    assert contents(final) == OLD


# Fallback calls: rename final->old, rename tmp->final, rename old->tmp, rmtree.
# Exchange calls: renameat2, rmtree.
@pytest.mark.parametrize(
    "exchange, step, survivor",
    [(False, 0, OLD), (False, 1, OLD), (False, 2, NEW), (False, 3, NEW)]
    + [(True, 0, OLD), (True, 1, NEW)],
)
def test_crash_at_any_step_recovers_old_or_new(tmp_path, monkeypatch, exchange, step, survivor):
    if exchange and not exchange_works(tmp_path):
        pytest.skip("renameat2(RENAME_EXCHANGE) is unavailable here")
    final = tmp_path / "runs" / "r" / "weights" / "ckpt"
    publish(final, OLD)
    if exchange:
        die_before(monkeypatch, step, [(loading, "_renameat2"), (shutil, "rmtree")])
    else:
        no_exchange(monkeypatch)
        die_before(monkeypatch, step, [(Path, "rename"), (shutil, "rmtree")])
    with pytest.raises(Crash):
        publish(final, NEW)
    monkeypatch.undo()
    recover_published(tmp_path)
    assert contents(final) == survivor
    assert entries(final.parent) == ["ckpt"]


def test_crash_between_fallback_renames_restores_the_acknowledged_copy(tmp_path, monkeypatch):
    final = tmp_path / "ckpt"
    publish(final, OLD)
    no_exchange(monkeypatch)
    die_before(monkeypatch, 1, [(Path, "rename")])
    with pytest.raises(Crash):
        publish(final, NEW)
    monkeypatch.undo()
    assert not final.exists()  # the window: the old copy is parked, the new one not in place
    parked = [n for n in entries(tmp_path) if ".old-" in n]
    assert len(parked) == 1 and contents(tmp_path / parked[0]) == OLD
    assert recover_published(tmp_path) == [final]
    assert contents(final) == OLD
    assert entries(tmp_path) == ["ckpt"]


def test_recovery_purges_leftovers_and_leaves_the_rest(tmp_path):
    root = tmp_path / "state"
    write(root / "a" / "ckpt", NEW)
    write(root / "a" / ".ckpt.old-0123abcd", OLD)  # final present: a finished overwrite
    write(root / "a" / ".ckpt.tmp-89abcdef", NEW)  # an interrupted write
    write(root / "a" / "b" / ".x.y.tmp-00000000", NEW)  # names with dots, nested
    write(root / ".cache", OLD)  # hidden but not ours
    write(root / "a" / ".ckpt.tmp-notahex0", OLD)
    assert recover_published(root) == []
    assert entries(root / "a") == [".ckpt.tmp-notahex0", "b", "ckpt"]
    assert entries(root / "a" / "b") == []
    assert contents(root / "a" / "ckpt") == NEW
    assert contents(root / ".cache") == OLD
    assert contents(root / "a" / ".ckpt.tmp-notahex0") == OLD


def test_recovery_does_not_follow_symlinks(tmp_path):
    outside = tmp_path / "outside"
    write(outside / ".ckpt.tmp-0123abcd", OLD)
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "link").symlink_to(outside)
    (tmp_path / "root" / ".x.tmp-0123abcd").symlink_to(outside)
    recover_published(tmp_path / "root")
    assert contents(outside / ".ckpt.tmp-0123abcd") == OLD


CHILD = textwrap.dedent(
    """
    import errno, sys, time
    from pathlib import Path
    from furlong.models import loading

    final, marker, data = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].encode()
    loading._renameat2 = lambda src, dst, flags: errno.ENOSYS  # force the two-rename path
    rename = Path.rename

    def parked_then_block(self, target):
        if Path(target) == final:  # second rename: the old copy is parked by now
            marker.write_text("parked")
            time.sleep(600)
        return rename(self, target)

    Path.rename = parked_then_block
    tmp, _ = loading.atomic_dir(final)
    (tmp / "model.safetensors").write_bytes(data)
    loading.publish_dir(tmp, final)
    """
)


def test_sigkill_between_fallback_renames_then_recovery(tmp_path):
    final, marker = tmp_path / "ckpt", tmp_path / "marker"
    publish(final, OLD)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(final), str(marker), "new"])
    try:
        while not marker.exists():  # the child imports torch first: seconds
            assert child.poll() is None, "the child exited before parking the old copy"
            time.sleep(0.05)
        assert not final.exists()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert recover_published(tmp_path) == [final]
    assert contents(final) == OLD
    assert entries(tmp_path) == ["ckpt", "marker"]


def test_remove_dir_never_leaves_a_half_deleted_copy_under_its_name(tmp_path, monkeypatch):
    final = tmp_path / "ckpt"
    final.mkdir()
    write(final, OLD)

    def die(path, *args, **kwargs):  # the process dies part-way through the delete
        (Path(path) / "model.safetensors").unlink()
        raise Crash

    monkeypatch.setattr(loading.shutil, "rmtree", die)
    with pytest.raises(Crash):
        loading.remove_dir(final)
    assert not final.exists()  # gone whole, not half-deleted under its real name
    monkeypatch.undo()
    assert recover_published(tmp_path) == [] and os.listdir(tmp_path) == []
