"""Fair sampling: a tenant's small request joins at the next free slot of a shared engine, not
behind another tenant's whole queue, and gets the tokens it would get alone."""

from __future__ import annotations

import pytest

from furlong.errors import InputError
from furlong.models import build_preset
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sampling import SamplingParams
from furlong.server.sample_feeder import FairFeeder

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = [5, 17, 300, 42, 9]


@pytest.fixture(scope="module")
def engine(one_thread) -> EmbeddedEngine:
    model, tokenizer = build_preset("tiny-qwen3", seed=0)
    return EmbeddedEngine(model, tokenizer, max_running=4)


def params(n: int, max_tokens: int, seed: int) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=max_tokens, seed=seed + i, stop_token_ids=()) for i in range(n)
    ]


def test_a_small_request_overtakes_another_tenants_queue(engine) -> None:
    alone = FairFeeder(engine).submit("a", [PROMPT], params(1, 4, 99))[0].result(60)
    feeder = FairFeeder(engine)
    heavy = feeder.submit("b", [PROMPT] * 40, params(40, 12, 0))
    light = feeder.submit("a", [PROMPT], params(1, 4, 99))[0]
    result = light.result(120)
    finished = sum(f.done() for f in heavy)
    # FIFO would finish all 40 first; with a slot kept free of b, a starts at the next decode
    # step and its 4 tokens end before any of b's 12-token sequences
    assert feeder.per_tenant == feeder.window - 1 == 3
    assert finished == 0 and feeder.queued() == 40 - 3
    assert result.output_ids == alone.output_ids and len(result.output_ids) == 4
    assert all(len(f.result(120).output_ids) == 12 for f in heavy)


def test_a_bad_request_is_refused_whole_and_queues_nothing(engine) -> None:
    feeder = FairFeeder(engine)
    too_long = [PROMPT, [7] * engine.context_length]
    with pytest.raises(InputError, match=r"params\[1\]\.max_tokens: .* exceed the model's context"):
        feeder.submit("a", too_long, params(2, 4, 0))
    assert feeder.queued() == 0
    ok = feeder.submit("a", [PROMPT], params(1, 3, 0))[0].result(60)
    assert len(ok.output_ids) == 3


def test_engine_failures_reach_the_sequence_and_free_the_slot(engine, monkeypatch) -> None:
    feeder = FairFeeder(engine, window=1)
    calls = []
    original = engine.submit

    def flaky(prompt, sp, request_id=None):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("engine gone")
        return original(prompt, sp, request_id)

    monkeypatch.setattr(engine, "submit", flaky)
    first, second = feeder.submit("a", [PROMPT] * 2, params(2, 2, 0))
    with pytest.raises(RuntimeError, match="engine gone"):
        first.result(60)
    assert len(second.result(60).output_ids) == 2
