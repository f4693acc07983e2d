"""The shared compute lane: one operation computes at a time, tenants take turns round-robin,
and a long loss pass lets another tenant's work in between its microbatches without changing
anyone's results (LoRA adapters on one shared base included)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from furlong.server.compute_lane import ComputeLane
from furlong.server.models import LoraSpec, ModelPool
from furlong.train.engine import EngineConfig
from furlong.train.turns import turn_point
from tests.train.helpers import grads, random_datums

pytestmark = pytest.mark.usefixtures("one_thread")


def blocker(lane: ComputeLane) -> tuple[threading.Event, object]:
    """Hold the lane until the returned event is set, so others queue in a known order."""
    go, started = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        go.wait(30)

    future = lane.submit("holder", hold)
    assert started.wait(30)
    return go, future


def wait_queued(lane: ComputeLane, n: int) -> None:
    for _ in range(3000):
        if lane.waiting() >= n:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"{n} operations never queued")


def test_round_robin_across_tenants_and_turns_at_turn_points() -> None:
    lane, log = ComputeLane(), []

    def unit(name: str, units: int = 1):
        def run() -> str:
            for k in range(units):
                if k:
                    turn_point()
                log.append(f"{name}{k}")
            return name

        return run

    go, held = blocker(lane)
    futures = [lane.submit("heavy", unit("H", 3))]
    wait_queued(lane, 1)
    futures += [lane.submit("heavy", unit("h"))]  # the same tenant's second operation
    wait_queued(lane, 2)
    futures += [lane.submit("light", unit("L"))]
    wait_queued(lane, 3)
    go.set()
    assert [f.result(30) for f in futures] == ["H", "h", "L"] and held.result(30) is None
    # H's first unit, then the light tenant (its turn came before heavy's second op), ...
    assert log == ["H0", "L0", "h0", "H1", "H2"]
    assert lane.turns_passed == 1  # H2 had no one to wait for


def test_a_turn_point_without_waiters_keeps_the_lane() -> None:
    lane = ComputeLane()

    def run() -> int:
        for _ in range(5):
            turn_point()
        return 5

    assert lane.submit("solo", run).result(30) == 5 and lane.turns_passed == 0


def test_errors_release_the_lane() -> None:
    lane = ComputeLane()

    def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        lane.submit("a", fail).result(30)
    assert lane.submit("b", lambda: 7).result(30) == 7


def test_lora_passes_interleaved_between_microbatches_equal_passes_alone(tmp_path: Path) -> None:
    """Two adapters on one shared base: B's 4-microbatch forward_backward lets A's forward and
    forward_backward run between its microbatches; every gradient and log-prob equals the same
    calls run one after the other."""
    config = EngineConfig(max_tokens_per_microbatch=12)  # B's datums take one microbatch each
    heavy = random_datums([9, 8, 7, 6], "cross_entropy", seed=1)
    light = random_datums([5], "cross_entropy", seed=2)

    def pool(root: Path):
        p = ModelPool({"b": "tiny-qwen3"}, tokenizer_root=root, engine_config=config)
        return p.create("t:train:0", "b", LoraSpec(rank=4)), p.create(
            "t:train:1", "b", LoraSpec(rank=2, seed=9)
        )

    a, b = pool(tmp_path / "alone")
    b.forward_backward(heavy, "cross_entropy", None, False)
    a.forward_backward(light, "cross_entropy", None, False)
    want_lp = a.forward_backward(light, "cross_entropy", None, True).outputs[0]["logprobs"]
    want_a, want_b = grads(a.engine), grads(b.engine)

    a, b = pool(tmp_path / "shared")
    lane = ComputeLane()
    go, _ = blocker(lane)
    fb = lane.submit("bob", b.forward_backward, heavy, "cross_entropy", None, False)
    wait_queued(lane, 1)
    light_fb = lane.submit("alice", a.forward_backward, light, "cross_entropy", None, False)
    wait_queued(lane, 2)
    go.set()
    light_fb.result(60)
    forward = lane.submit("alice", a.forward_backward, light, "cross_entropy", None, True)
    got_lp = forward.result(60).outputs[0]["logprobs"]
    fb.result(60)
    assert lane.turns_passed >= 1  # B really gave its turn away mid-pass
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=0)
    for want, engine in ((want_a, a.engine), (want_b, b.engine)):
        got = grads(engine)
        assert got.keys() == want.keys() and any(g.abs().sum() > 0 for g in got.values())
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
