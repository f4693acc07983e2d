"""The rollout engine's own bounds: prompt + max_tokens within the model's context is checked
before anything is queued or allocated, and a step that fails frees its batch and hands the
heap back, so the engine keeps serving."""

from __future__ import annotations

import pytest

from furlong import host_memory
from furlong.errors import InputError
from furlong.models import build_preset
from furlong.rollout import engine as engine_module
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = [5, 17, 300, 42]


@pytest.fixture()
def engine() -> EmbeddedEngine:
    model, tokenizer = build_preset("tiny-qwen3", seed=0)
    return EmbeddedEngine(model, tokenizer, max_running=4)


def test_prompt_plus_max_tokens_beyond_the_context_is_refused_whole(engine) -> None:
    context = engine.context_length
    assert context == 2048
    fits = SamplingParams(max_tokens=context - len(PROMPT), seed=0)
    engine.check_requests([PROMPT], fits)  # exactly the context: fine
    over = SamplingParams(max_tokens=context - len(PROMPT) + 1, seed=0)
    with pytest.raises(InputError, match=r"params\[1\]\.max_tokens: 4 prompt tokens \+ max_tokens"):
        engine.submit_many([PROMPT, PROMPT], [SamplingParams(max_tokens=2), over])
    with pytest.raises(InputError, match=r"params\[0\]\.max_tokens: 2049 prompt tokens"):
        engine.generate([[7] * 2049], SamplingParams(max_tokens=1))
    assert engine.steps == 0  # nothing ran


def test_a_failed_step_frees_the_batch_and_the_engine_keeps_serving(engine, monkeypatch) -> None:
    released = []
    monkeypatch.setattr(engine_module, "release_host_memory", lambda: released.append(1))
    original = engine._step

    def fail_once(joining):
        monkeypatch.setattr(engine, "_step", original)
        raise MemoryError("KV cache allocation failed")

    monkeypatch.setattr(engine, "_step", fail_once)
    failed = engine.submit(PROMPT, SamplingParams(max_tokens=3, seed=0, stop_token_ids=()))
    with pytest.raises(MemoryError, match="KV cache"):
        failed.result(60)
    assert released == [1]
    assert engine._batch.running == [] and engine._batch.cache is None
    ok = engine.generate([PROMPT], SamplingParams(max_tokens=3, seed=0, stop_token_ids=()))
    assert len(ok[0].output_ids) == 3


def test_release_host_memory_runs() -> None:
    host_memory.release_host_memory()  # gc + malloc_trim where glibc has it; never raises
