"""Optimizer state in file-backed mappings (``state_store="disk"``): trajectories identical to
memory, unlinked reserved files, idempotent adoption, msync before checkpoints, ENOSPC at
allocation, validation and stale-directory clean-up."""

from __future__ import annotations

import errno
import logging
import os
import socket
from pathlib import Path

import pytest
import torch

from furlong.errors import InputError
from furlong.train import checkpoint as ckpt
from furlong.train import filemap, offload
from furlong.train.engine import EngineConfig, TrainingEngine
from furlong.train.optim import OptimizerConfig
from furlong.types import AdamParams
from tests.train.helpers import params, random_datums

pytestmark = pytest.mark.usefixtures("one_thread")
ADAM = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1)


def engine(preset: str = "tiny-qwen3", kind: str = "adamw", disk: Path | None = None, **kw):
    store = {"state_store": "disk", "disk_dir": str(disk)} if disk else {}
    config = EngineConfig(optimizer=OptimizerConfig(kind=kind, **store, **kw))
    return TrainingEngine.from_pretrained(preset, config, seed=0)


def train(e: TrainingEngine, steps: int, seed: int = 0) -> None:
    for i in range(steps):
        e.forward_backward(random_datums([6, 4], seed=seed + i), "cross_entropy")
        e.optim_step(ADAM)


def state_tensors(e: TrainingEngine) -> dict[str, torch.Tensor]:
    return {
        f"{n}.{k}": v
        for n, p in zip(e.param_names, e.params, strict=True)
        for k, v in e.optimizer.state.get(p, {}).items()
    }


def mapped_bytes(e: TrainingEngine) -> int:
    return sum(v.nbytes for v in state_tensors(e).values() if v.dim() > 0)


def deleted_maps(directory: Path) -> int:
    """Live mappings of unlinked files of ``directory`` in this process."""
    prefix = f"{directory}/"
    lines = Path("/proc/self/maps").read_text().splitlines()
    return len({ln.split()[-2] for ln in lines if prefix in ln and ln.endswith("(deleted)")})


# ---------------------------------------------------------------- trajectories


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_disk_trajectory_is_bit_identical_to_memory(preset, kind, tmp_path) -> None:
    memory, disk = engine(preset, kind), engine(preset, kind, tmp_path)
    train(memory, 4)
    train(disk, 4)
    pm, pd = params(memory), params(disk)
    assert all(torch.equal(pm[n], pd[n]) for n in pm)
    sm, sd = state_tensors(memory), state_tensors(disk)
    assert sm.keys() == sd.keys() and all(torch.equal(sm[k], sd[k]) for k in sm)
    assert all(filemap.is_file_backed(v) for v in sd.values() if v.dim() > 0)
    store = disk.optimizer.store
    assert store.allocator.allocated_bytes == mapped_bytes(disk) > 0


def test_streamed_step_equals_the_direct_step(tmp_path, caplog) -> None:
    """The accelerator path (state copied per chunk, other gradients hidden), forced on CPU."""
    memory = engine("tiny-qwen3-moe", "muon")
    disk = engine("tiny-qwen3-moe", "muon", tmp_path, chunk_bytes=64 << 10)
    disk.optimizer.store.stream = True
    with caplog.at_level(logging.WARNING, logger="furlong.train.offload"):
        train(memory, 3)
        train(disk, 3)
    pm, pd = params(memory), params(disk)
    assert all(torch.equal(pm[n], pd[n]) for n in pm)
    assert all(filemap.is_file_backed(v) for v in state_tensors(disk).values() if v.dim() > 0)
    assert all(p.grad is None for p in disk.params)
    assert "streamed as one chunk" in caplog.text  # the 768x64 embedding's state > 64 KiB


# ---------------------------------------------------------------- the allocator


def test_no_state_file_is_visible_after_mapping(tmp_path) -> None:
    alloc = filemap.FileAllocator(filemap.process_dir(tmp_path))
    tensors = [alloc.empty((64, 32), torch.float32), alloc.empty((7,), torch.bfloat16)]
    tensors[0].fill_(1.5)
    assert list(alloc.directory.iterdir()) == []
    assert deleted_maps(alloc.directory) == 2
    assert alloc.allocated_bytes == 64 * 32 * 4 + 7 * 2
    assert float(tensors[0].sum()) == 1.5 * 64 * 32 and not tensors[0].is_pinned()


def test_adoption_is_idempotent(tmp_path) -> None:
    alloc = filemap.FileAllocator(filemap.process_dir(tmp_path))
    source = torch.randn(16, 16)
    mapped = alloc.adopt(source)
    assert torch.equal(mapped, source) and filemap.is_file_backed(mapped)
    assert not filemap.is_file_backed(source)
    maps, nbytes = deleted_maps(alloc.directory), alloc.allocated_bytes
    for again in (mapped, mapped.detach(), mapped.view(-1)):
        assert alloc.adopt(again) is again  # no copy, no new file
    assert (deleted_maps(alloc.directory), alloc.allocated_bytes) == (maps, nbytes)
    assert list(alloc.directory.iterdir()) == []


def test_enospc_surfaces_at_allocation(tmp_path, monkeypatch) -> None:
    e = engine(disk=tmp_path)
    e.forward_backward(random_datums([5]), "cross_entropy")
    before = params(e)

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"cannot reserve .* \(No space left on device\)") as info:
        e.optim_step(ADAM)
    assert info.value.errno == errno.ENOSPC
    assert list(e.optimizer.store.allocator.directory.iterdir()) == []  # nothing left behind
    assert all(torch.equal(before[n], p) for n, p in params(e).items())


def test_unsupported_fallocate_falls_back_to_ftruncate(tmp_path, monkeypatch) -> None:
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    alloc = filemap.FileAllocator(filemap.process_dir(tmp_path))
    t = alloc.empty((128,), torch.float32)
    assert torch.count_nonzero(t) == 0 and filemap.is_file_backed(t)


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_msync_runs_before_checkpoint_writes_and_counters_add_up(
    kind, tmp_path, monkeypatch, caplog
) -> None:
    e = engine("tiny-qwen3-moe", kind, tmp_path / "disk")
    with caplog.at_level(logging.INFO, logger="furlong.train.offload"):
        train(e, 2)
    steps = [r for r in caplog.records if "bytes file-backed" in r.getMessage()]
    assert len(steps) == 2 and f"{mapped_bytes(e)} bytes" in steps[-1].getMessage()
    events: list[tuple[str, int]] = []
    real_msync, real_save = filemap._msync, ckpt.save_file

    def msync(address: int, nbytes: int) -> None:
        events.append(("msync", nbytes))
        real_msync(address, nbytes)

    def save_file(tensors, filename, *args, **kwargs):
        events.append(("write", 0))
        return real_save(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(filemap, "_msync", msync)
    monkeypatch.setattr(ckpt, "save_file", save_file)
    alloc = e.optimizer.store.allocator
    e.save_state(tmp_path / "a")
    first_write = events.index(("write", 0))
    synced = [n for what, n in events[:first_write] if what == "msync"]
    assert all(what == "write" for what, _ in events[first_write:])
    assert sum(synced) == alloc.flushed_bytes == alloc.allocated_bytes == mapped_bytes(e)
    assert alloc.msync_calls == len(synced) == sum(1 for v in state_tensors(e).values() if v.dim())
    e.save_state(tmp_path / "b")
    assert alloc.flushed_bytes == 2 * alloc.allocated_bytes


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_disk_checkpoint_continues_identically(kind, tmp_path) -> None:
    a = engine("tiny-qwen3-moe", kind, tmp_path / "disk")
    train(a, 2)
    a.save_state(tmp_path / "ckpt")
    train(a, 2, seed=10)
    b = engine("tiny-qwen3-moe", kind, tmp_path / "disk")
    b.load_state(tmp_path / "ckpt")
    state = state_tensors(b)
    assert all(filemap.is_file_backed(v) for v in state.values() if v.dim() > 0)  # adopted
    alloc = b.optimizer.store.allocator
    assert alloc.allocated_bytes == mapped_bytes(b)
    b.optimizer.store.adopt(b.optimizer.parts)  # again: nothing new
    assert alloc.allocated_bytes == mapped_bytes(b)
    train(b, 2, seed=10)
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


def test_sleep_leaves_file_backed_state_in_place(tmp_path) -> None:
    slept, control = engine(disk=tmp_path), engine()
    train(slept, 1)
    train(control, 1)
    state = state_tensors(slept)
    moved = slept.sleep()
    assert moved == sum(p.nbytes for p in control.params) + sum(  # weights + scalar steps
        v.nbytes for v in state.values() if v.dim() == 0
    )
    after = state_tensors(slept)
    assert all(after[k] is v for k, v in state.items() if v.dim())  # mapped, not moved
    slept.wake()
    train(slept, 1, seed=5)
    train(control, 1, seed=5)
    pc, ps = params(control), params(slept)
    assert all(torch.equal(pc[n], ps[n]) for n in pc)


# ---------------------------------------------------------------- validation and set-up


def test_tmpfs_directory_is_refused(tmp_path, monkeypatch) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\ntmpfs {tmp_path}/ram tmpfs rw 0 0\n")
    monkeypatch.setattr(filemap, "MOUNTS", str(mounts))
    (tmp_path / "ram").mkdir()
    with pytest.raises(InputError, match=r"optimizer.disk_dir: .*ram/state is on tmpfs"):
        engine(disk=tmp_path / "ram" / "state")
    assert filemap.filesystem_type(tmp_path / "disk") == "ext4"


def test_real_shm_is_refused_when_it_is_tmpfs() -> None:
    if filemap.filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    with pytest.raises(InputError, match="tmpfs"):
        offload.DiskStore("/dev/shm", 1 << 20)


def test_chunk_size_zero_and_unknown_store_are_refused(tmp_path) -> None:
    with pytest.raises(InputError, match="optimizer.chunk_bytes: must be an integer > 0"):
        offload.DiskStore(tmp_path, 0)
    with pytest.raises(InputError, match="optimizer.state_store: 'ssd'"):
        offload.make_store("ssd", str(tmp_path), 1 << 20)


def test_stale_directories_of_dead_processes_are_purged(tmp_path) -> None:
    root = tmp_path / filemap.STATE_SUBDIR
    host = socket.gethostname()
    stale = [f"rank00000-{host}-{os.getpid()}-1", f"rank00003-{host}-999999999-5"]  # reused pid
    kept = ["rank00000-otherhost-123-4", "notes"]  # another host's; not a state directory
    for name in stale + kept:
        (root / name).mkdir(parents=True)
        (root / name / "state-x").write_bytes(b"x")
    mine = filemap.process_dir(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == sorted([*kept, mine.name])
    assert mine.name.startswith(f"rank00000-{host}-{os.getpid()}-")
    assert filemap.process_dir(tmp_path) == mine  # idempotent
