"""Sampling-mask replay inside the TrainingEngine: with the rollout's kept sets the trainer's
log-probs equal the engine's sampling log-probs; without them they differ."""

from __future__ import annotations

import pytest
import torch

from furlong.errors import InputError
from furlong.models import build_preset
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sampling import SamplingParams
from furlong.rollout.sampling_mask import SamplingMask
from furlong.train.engine import EngineConfig, TrainingEngine
from tests.train.helpers import grads, sequence_datum

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def rollouts():
    model, tokenizer = build_preset("tiny-qwen3", seed=0)
    prompts = [tokenizer(f"What is {i} + 1?")["input_ids"] for i in range(4)]
    params = [
        SamplingParams(
            max_tokens=6 + 3 * i,
            seed=i,
            stop_token_ids=(),
            top_p=0.7,
            top_k=20,
            temperature=0.9,
            return_sampling_mask=True,
        )
        for i in range(4)
    ]
    results = EmbeddedEngine(model, tokenizer).generate(prompts, params)
    datums = [
        sequence_datum(r.prompt_ids + r.output_ids, len(r.output_ids), r.output_logprobs)
        for r in results
    ]
    return model, tokenizer, results, datums


@pytest.mark.parametrize("budget", [0, 24])
def test_replayed_logprobs_equal_sampling_logprobs(rollouts, budget: int) -> None:
    model, tokenizer, results, datums = rollouts
    trainer = TrainingEngine(model, tokenizer, EngineConfig(max_tokens_per_microbatch=budget))
    masks = [r.sampling_mask for r in results]
    replayed = trainer.forward(datums, "ppo", temperature=0.9, sampling_masks=masks)
    plain = trainer.forward(datums, "ppo", temperature=0.9)
    for r, a, b in zip(results, replayed.outputs, plain.outputs, strict=True):
        n = len(r.output_ids)
        engine_lp = torch.tensor(r.output_logprobs)
        torch.testing.assert_close(a["logprobs"][-n:], engine_lp, atol=1e-5, rtol=0)
        assert (b["logprobs"][-n:] - engine_lp).abs().max() > 1e-2
        # unmasked rows: the same scores (the replay path is the generic kernel, not the fused)
        torch.testing.assert_close(a["logprobs"][:-n], b["logprobs"][:-n], atol=1e-6, rtol=0)
    # with replay, ratio = 1 everywhere: the PPO loss is exactly -sum(A) per datum
    for r, out in zip(results, replayed.outputs, strict=True):
        assert float(out["loss"]) == pytest.approx(-len(r.output_ids), abs=1e-4)


def test_singleton_positions_get_no_gradient(rollouts) -> None:
    model, tokenizer, results, datums = rollouts
    d = datums[0]
    n = len(results[0].output_ids)
    forced = SamplingMask.singletons(d.loss_fn_inputs["target_tokens"][-n:])
    trainer = TrainingEngine(build_preset("tiny-qwen3", seed=0)[0], tokenizer)
    out = trainer.forward_backward([d], "importance_sampling", sampling_masks=[forced])
    assert out.outputs[0]["logprobs"][-n:].abs().max() == 0.0
    prompt_rows = len(d) - n  # advantages are 0 there, so no gradient at all
    assert prompt_rows > 0
    assert all(not g.any() for g in grads(trainer).values())


def test_bad_masks_are_rejected_before_compute(rollouts) -> None:
    model, tokenizer, results, datums = rollouts
    trainer = TrainingEngine(build_preset("tiny-qwen3", seed=0)[0], tokenizer)
    trainer.forward_backward(datums[:1], "ppo")
    before = grads(trainer)
    wrong = SamplingMask.from_lists([[1]] * len(results[1].output_ids))
    with pytest.raises(InputError, match=r"sampling_masks\[1\]: .*not in its kept-token set"):
        trainer.forward_backward(datums[:2], "ppo", sampling_masks=[None, wrong])
    with pytest.raises(InputError, match="1 masks for 2 datums"):
        trainer.forward_backward(datums[:2], "ppo", sampling_masks=[None])
    too_long = SamplingMask.singletons(torch.zeros(len(datums[0]) + 1, dtype=torch.long))
    with pytest.raises(InputError, match=r"sampling_masks\[0\]: .* positions"):
        trainer.forward_backward(datums[:1], "ppo", sampling_masks=[too_long])
    after = grads(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)
