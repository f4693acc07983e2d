"""The rollout engine prefills a prompt shared by several requests (GRPO groups) once and
copies its KV cache, with the samples of the plain path."""

from __future__ import annotations

import pytest
import torch

from furlong.models.presets import build_preset
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.model_runner import ModelRunner
from furlong.rollout.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def test_duplicate_prompts_prefill_once_with_the_same_samples(monkeypatch) -> None:
    model, tokenizer = build_preset("tiny-qwen3", seed=0)
    prompts = [[5, 6, 7, 8], [9, 10, 11]] * 4
    params = [SamplingParams(max_tokens=6, seed=i, stop_token_ids=()) for i in range(8)]
    engine = EmbeddedEngine(model, tokenizer, max_running=8)
    calls = []
    real = ModelRunner._prefill_once
    monkeypatch.setattr(
        ModelRunner, "_prefill_once", lambda self, *a: calls.append(1) or real(self, *a)
    )
    shared = engine.generate(prompts, params)
    assert calls
    monkeypatch.setattr(ModelRunner, "_prefill_once", lambda self, *a: None)
    plain = EmbeddedEngine(model, tokenizer, max_running=8).generate(prompts, params)
    for a, b in zip(shared, plain, strict=True):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(
            torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5, rtol=0
        )
