"""CheckpointTtl on a bare StateDir: the sweep (expired checkpoints, orphan expiry files, temp
files of interrupted writes), the background sweeper, and a failed save's rollback."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from furlong.errors import InputError
from furlong.server.checkpoint_ttl import CheckpointTtl, check_ttl
from furlong.server.state import CheckpointRef, StateDir
from tests.server.test_sdk_checkpoints import HOUR, Clock

RUN = "sess:train:0"


def checkpoint(state: StateDir, segment: str, name: str) -> CheckpointRef:
    ref = CheckpointRef(RUN, segment, name)
    state.checkpoint_dir(ref).mkdir(parents=True)
    (state.checkpoint_dir(ref) / "model.safetensors").write_bytes(b"x" * 10)
    return ref


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Clock, StateDir, CheckpointTtl, list[Path]]:
    clock = Clock()
    state = StateDir(tmp_path, clock=clock)
    state.write_run(RUN, {"base_model": "tiny-qwen3", "owner": "o"})
    forgotten: list[Path] = []
    return clock, state, CheckpointTtl(state, forgotten.append), forgotten


def test_sweep_deletes_what_expired_and_cleans_up(setup) -> None:
    clock, state, ttl, forgotten = setup
    a, b = checkpoint(state, "weights", "a"), checkpoint(state, "external_weights", "b")
    ttl.set(a, HOUR)
    ttl.set(b, 2 * HOUR)
    orphan = state.expiry_file(CheckpointRef(RUN, "weights", "gone"))
    orphan.write_text('{"expires_at": 0}')
    dead_write = orphan.with_name(".a.expires.tmp123-456")
    dead_write.write_text("{")
    assert ttl.sweep() == []
    assert not orphan.exists() and not dead_write.exists()
    assert [c["checkpoint_id"] for c in state.checkpoints(RUN)] == [
        "weights/a",
        "external_weights/b",
    ]
    clock.now += HOUR
    assert [c["checkpoint_id"] for c in state.checkpoints(RUN)] == ["external_weights/b"]
    with pytest.raises(KeyError):  # NotFound: neither listed nor found, before any sweep
        state.owned_checkpoint("o", a)
    assert ttl.sweep() == [a.uri]
    assert forgotten == [state.checkpoint_dir(a)]
    assert not state.checkpoint_dir(a).exists() and not state.expiry_file(a).exists()
    assert state.owned_checkpoint("o", b).is_dir()


def test_the_background_sweeper_deletes_expired_checkpoints(setup) -> None:
    clock, state, ttl, _ = setup
    ref = checkpoint(state, "sampler_weights", "s")
    ttl.set(ref, HOUR)
    clock.now += HOUR
    stop = ttl.start(0.01)
    try:
        deadline = time.monotonic() + 60  # a bound on the wait, not a timing assertion
        while state.checkpoint_dir(ref).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
    assert not state.checkpoint_dir(ref).exists()


def test_a_failed_save_keeps_the_old_expiry(setup) -> None:
    clock, state, ttl, _ = setup
    ref = checkpoint(state, "weights", "w")
    ttl.set(ref, HOUR)
    before = state.expires_at(ref)
    with pytest.raises(RuntimeError), ttl.saving(ref, 5 * HOUR):
        assert state.expires_at(ref) == clock.now + 5 * HOUR  # on disk before the publish
        raise RuntimeError("disk full")
    assert state.expires_at(ref) == before
    fresh = CheckpointRef(RUN, "weights", "never-written")
    with pytest.raises(RuntimeError), ttl.saving(fresh, HOUR):
        raise RuntimeError("disk full")
    assert not state.expiry_file(fresh).exists()


@pytest.mark.parametrize("bad", [0, 3599, 10 * 365 * 86400 + 1, True, 1.5, "3600"])
def test_ttl_bounds_name_the_field(bad) -> None:
    with pytest.raises(InputError, match="^ttl_seconds: "):
        check_ttl(bad)
    assert check_ttl(None) is None and check_ttl(HOUR) == HOUR
