"""SnapshotCache: one build per snapshot however many ask, sizes known (and room made) before
anything is built, least-recently-used engines released within a byte and a count budget, idle
and unused engines released, failed builds not kept, and a released engine rebuilt on use."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest

from furlong.server.snapshot_cache import SnapshotCache

SIZES = {Path("a"): 40, Path("b"): 30, Path("c"): 50, Path("huge"): 500}


class Lane:
    """Runs nothing until told: what the compute lane does with a queued build."""

    def __init__(self) -> None:
        self.queued: list[tuple[str, object, Future]] = []

    def __call__(self, owner: str, fn) -> Future:
        future: Future = Future()
        self.queued.append((owner, fn, future))
        return future

    def run_all(self) -> None:
        while self.queued:
            _, fn, future = self.queued.pop(0)
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - the future carries it
                future.set_exception(exc)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(max_bytes: int = 100, max_engines: int = 8, idle_s: float = 0.0, fail=()):
    events: list[str] = []
    lane, clock = Lane(), Clock()

    def size(path: Path) -> int:
        events.append(f"size {path}")
        return SIZES[path]

    def build(path: Path) -> object:
        events.append(f"build {path}")
        if path in fail:
            raise OSError(f"cannot read {path}")
        return f"engine {path}"

    cache = SnapshotCache(
        build, size, lane, max_bytes=max_bytes, max_engines=max_engines, idle_s=idle_s, clock=clock
    )
    return cache, lane, clock, events


def loaded_paths(cache: SnapshotCache) -> list[Path]:
    return list(cache._entries)


def test_concurrent_requests_share_one_build_run_as_the_tenants_work() -> None:
    cache, lane, _, events = make()
    first = cache.engine("alice", Path("a"), "s1")
    second = cache.engine("bob", Path("a"), "s2")
    assert first is second and not first.done()  # nothing is built on the caller's thread
    assert [owner for owner, _, _ in lane.queued] == ["alice"]
    lane.run_all()
    assert first.result() == "engine a"
    assert cache.engine("bob", Path("a")).result() == "engine a"  # loaded: done at once
    assert events == ["size a", "size a", "build a", "size a"] and cache.builds == 1


def test_room_is_made_by_size_before_the_build_least_recently_used_first() -> None:
    cache, lane, _, events = make(max_bytes=100)
    for name in ("a", "b"):  # 40 + 30 bytes
        cache.engine("t", Path(name))
    lane.run_all()
    cache.engine("t", Path("a"))  # a is now more recent than b
    events.clear()
    cache.engine("t", Path("c"))  # 50 more: 120 > 100, so b (least recent) goes first
    assert events == ["size c"]  # sized and room made; the build has not run yet
    assert loaded_paths(cache) == [Path("a"), Path("c")]
    assert cache.loaded() == (2, 90)
    lane.run_all()
    assert events == ["size c", "build c"]


def test_the_count_budget_and_a_snapshot_larger_than_the_whole_budget() -> None:
    cache, lane, _, _ = make(max_bytes=1000, max_engines=2)
    for name in ("a", "b", "c"):
        cache.engine("t", Path(name))
    assert loaded_paths(cache) == [Path("b"), Path("c")]
    cache, lane, _, _ = make(max_bytes=100)
    cache.engine("t", Path("a"))
    huge = cache.engine("t", Path("huge"))  # alone over budget: still served, alone
    lane.run_all()
    assert huge.result() == "engine huge" and loaded_paths(cache) == [Path("huge")]


def test_a_released_engine_is_rebuilt_from_its_files_on_next_use() -> None:
    cache, lane, _, events = make(max_engines=1)
    cache.engine("t", Path("a"))
    lane.run_all()
    cache.engine("t", Path("b"))  # releases a
    lane.run_all()
    again = cache.engine("t", Path("a"))
    lane.run_all()
    assert again.result() == "engine a"
    assert [e for e in events if e.startswith("build")] == ["build a", "build b", "build a"]


def test_idle_engines_and_engines_whose_samplers_are_gone_are_released() -> None:
    cache, lane, clock, _ = make(max_bytes=1000, idle_s=60)
    cache.engine("t", Path("a"), "s1")
    cache.engine("t", Path("b"), "s2")
    cache.engine("t", Path("b"), "s3")
    clock.now = 50
    cache.engine("t", Path("c"))
    clock.now = 100  # a and b unused for 100 s, c for 50 s
    assert cache.release_idle() == 2 and loaded_paths(cache) == [Path("c")]
    cache.engine("t", Path("a"), "s1")
    cache.engine("t", Path("b"), "s2")
    cache.engine("t", Path("b"), "s3")
    assert cache.drop_users(["s1", "s2"]) == 1  # b still serves s3
    assert loaded_paths(cache) == [Path("c"), Path("b")]
    assert cache.drop_users(["s3"]) == 1 and loaded_paths(cache) == [Path("c")]


def test_a_failed_build_is_reported_and_not_kept() -> None:
    cache, lane, _, events = make(fail={Path("a")})
    failed = cache.engine("t", Path("a"))
    lane.run_all()
    with pytest.raises(OSError, match="cannot read a"):
        failed.result()
    assert loaded_paths(cache) == []
    cache.engine("t", Path("a"))  # tried again
    assert [e for e in events if e.startswith("build")] == ["build a"] and len(lane.queued) == 1


def test_moved_files_keep_their_loaded_engine() -> None:
    cache, lane, _, _ = make()
    cache.engine("t", Path("a"))
    lane.run_all()
    SIZES[Path("kept")] = 40
    cache.move(Path("a"), Path("kept"))
    assert cache.engine("t", Path("kept")).result() == "engine a" and cache.builds == 1
    cache.forget(Path("kept"))
    assert loaded_paths(cache) == []
