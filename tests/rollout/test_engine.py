"""Embedded rollout engine: continuous batching equals one-at-a-time, seeded reproducibility,
log-probs equal a teacher-forced trainer forward, kept-set replay, and stop rules."""

from __future__ import annotations

import pytest
import torch

from furlong.errors import InputError
from furlong.models import build_preset
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sampling import SamplingParams
from furlong.train.engine import TrainingEngine
from furlong.train.logprobs import masked_token_logprobs
from tests.train.helpers import sequence_datum

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    model, tokenizer = build_preset("tiny-qwen3", seed=0)
    prompts = [tokenizer(f"What is {i} + {2 * i}?")["input_ids"] for i in range(7)]
    return model, tokenizer, prompts


def never_stop(**kw) -> SamplingParams:
    return SamplingParams(stop_token_ids=(), **kw)


def test_continuous_batching_equals_one_at_a_time(setup) -> None:
    model, tokenizer, prompts = setup
    params = [never_stop(max_tokens=3 + 4 * i, seed=i, top_p=0.95) for i in range(7)]
    engine = EmbeddedEngine(model, tokenizer, max_running=3)  # 7 requests through 3 slots
    batched = engine.generate(prompts, params)
    for prompt, p, b in zip(prompts, params, batched, strict=True):
        (alone,) = engine.generate([prompt], [p])
        assert b.output_ids == alone.output_ids and b.finish_reason == "length"
        assert len(b.output_ids) == p.max_tokens
        torch.testing.assert_close(
            torch.tensor(b.output_logprobs), torch.tensor(alone.output_logprobs), atol=1e-5, rtol=0
        )


def test_same_seed_same_tokens(setup) -> None:
    model, tokenizer, prompts = setup
    engine = EmbeddedEngine(model, tokenizer)
    a = engine.generate(prompts[:2], never_stop(max_tokens=12, seed=5))
    b = engine.generate(prompts[:2], never_stop(max_tokens=12, seed=5))
    c = engine.generate(prompts[:2], never_stop(max_tokens=12, seed=6))
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert [r.output_ids for r in a] != [r.output_ids for r in c]


@pytest.mark.parametrize("fast_forward", [True, False], ids=["fast", "hf"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_teacher_forced_trainer_forward(
    setup, temperature: float, fast_forward: bool
) -> None:
    model, tokenizer, prompts = setup
    engine = EmbeddedEngine(model, tokenizer, fast_forward=fast_forward)
    assert (engine._runner.fast is not None) == fast_forward
    results = engine.generate(
        prompts[:3], never_stop(max_tokens=10, seed=1, temperature=temperature)
    )
    trainer = TrainingEngine(model, tokenizer)
    datums = [sequence_datum(r.prompt_ids + r.output_ids, len(r.output_ids)) for r in results]
    scored = trainer.forward(datums, "cross_entropy", temperature=temperature)
    for r, out in zip(results, scored.outputs, strict=True):
        trainer_lp = out["logprobs"][len(r.prompt_ids) - 1 :]
        torch.testing.assert_close(trainer_lp, torch.tensor(r.output_logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("params", [dict(top_p=0.6), dict(top_k=5, temperature=0.8)])
def test_mask_replay_reproduces_sampling_logprobs(setup, params: dict) -> None:
    model, tokenizer, prompts = setup
    p = never_stop(max_tokens=12, seed=3, return_sampling_mask=True, **params)
    (r,) = EmbeddedEngine(model, tokenizer).generate(prompts[:1], p)
    assert len(r.sampling_mask) == len(r.output_ids)
    tokens = torch.tensor([r.prompt_ids + r.output_ids])
    with torch.no_grad():
        logits = model(tokens).logits[0, len(r.prompt_ids) - 1 : -1]
    targets = torch.tensor(r.output_ids)
    ids, offsets = r.sampling_mask.tensors()
    temperature = params.get("temperature", 1.0)
    replayed = masked_token_logprobs(logits, targets, ids, offsets, temperature=temperature)
    engine_lp = torch.tensor(r.output_logprobs)
    torch.testing.assert_close(replayed, engine_lp, atol=1e-5, rtol=0)
    full = torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[:, None])[:, 0]
    assert (full - engine_lp).abs().max() > 1e-2  # without replay the trainer scores another policy


def test_stop_rules_include_the_terminator(setup) -> None:
    model, tokenizer, prompts = setup
    engine = EmbeddedEngine(model, tokenizer)
    (greedy,) = engine.generate(prompts[:1], never_stop(max_tokens=6, temperature=0))
    first, second = greedy.output_ids[:2]

    (r,) = engine.generate(
        prompts[:1], SamplingParams(max_tokens=6, temperature=0, stop_token_ids=(second,))
    )
    assert r.output_ids == greedy.output_ids[:2] and r.finish_reason == "stop"

    text = tokenizer.decode(greedy.output_ids[:3])
    (r,) = engine.generate(prompts[:1], never_stop(max_tokens=6, temperature=0, stop=(text[-1],)))
    assert r.finish_reason == "stop" and text[-1] in tokenizer.decode(r.output_ids)
    assert r.output_ids == greedy.output_ids[: len(r.output_ids)]

    model.generation_config.eos_token_id = first
    try:
        (r,) = EmbeddedEngine(model, tokenizer).generate(
            prompts[:1], SamplingParams(max_tokens=6, temperature=0)
        )
    finally:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    assert r.output_ids == [first] and r.finish_reason == "stop"

    assert greedy.finish_reason == "length" and len(greedy.output_ids) == 6


def test_bad_requests_name_the_prompt(setup) -> None:
    model, tokenizer, prompts = setup
    engine = EmbeddedEngine(model, tokenizer)
    with pytest.raises(InputError, match=r"prompts\[1\]: empty"):
        engine.generate([prompts[0], []], SamplingParams())
    with pytest.raises(InputError, match=r"prompts\[0\]: token id 99999"):
        engine.generate([[1, 99999]], SamplingParams())
    with pytest.raises(InputError, match="params: 1 for 2 prompts"):
        engine.generate(prompts[:2], [SamplingParams()])


def test_update_weights_publishes_trainer_weights(tmp_path) -> None:
    model, tokenizer = build_preset("tiny-qwen3", seed=0)
    engine = EmbeddedEngine(model, tokenizer)
    trainer = TrainingEngine.from_pretrained("tiny-qwen3", seed=1)  # different weights
    prompt = tokenizer("What is 1 + 1?")["input_ids"]
    params = never_stop(max_tokens=6, seed=0)

    def scored_by_trainer(r) -> torch.Tensor:
        d = sequence_datum(r.prompt_ids + r.output_ids)
        return trainer.forward([d], "cross_entropy").outputs[0]["logprobs"][len(prompt) - 1 :]

    (before,) = engine.generate([prompt], params)
    assert before.weight_version == 0
    assert (scored_by_trainer(before) - torch.tensor(before.output_logprobs)).abs().max() > 1e-3
    state = {n: p.detach() for n, p in trainer.model.named_parameters()}
    assert engine.update_weights(state) == 1
    (after,) = engine.generate([prompt], params)
    assert after.weight_version == 1
    torch.testing.assert_close(
        scored_by_trainer(after), torch.tensor(after.output_logprobs), atol=1e-5, rtol=0
    )
    trainer.export_hf(tmp_path / "hf")  # across processes: an HF dir of safetensors
    assert engine.update_weights(tmp_path / "hf") == 2


def test_update_weights_rejects_bad_tensors_without_changes(setup) -> None:
    model, tokenizer, _ = setup
    engine = EmbeddedEngine(model, tokenizer)
    before = {n: p.clone() for n, p in model.named_parameters()}
    name = next(iter(before))
    bad = {n: torch.zeros_like(p) for n, p in before.items()} | {name: torch.zeros(3)}
    with pytest.raises(InputError, match=f"{name!r} has shape"):
        engine.update_weights(bad)
    with pytest.raises(InputError, match="unknown tensors"):
        engine.update_weights({"nope": torch.zeros(1)})
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert engine.weight_version == 0


def test_prompt_and_top_logprobs_match_a_teacher_forced_forward(setup) -> None:
    model, tokenizer, prompts = setup
    params = never_stop(
        max_tokens=4, seed=2, prompt_logprobs=True, top_logprobs=3, prompt_top_logprobs=2
    )
    results = EmbeddedEngine(model, tokenizer).generate([prompts[0], prompts[5]], params)
    assert len(prompts[0]) != len(prompts[5])  # prefilled together, left-padded
    for r in results:
        tokens = torch.tensor([r.prompt_ids + r.output_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(tokens).logits[0].float(), -1)
        n = len(r.prompt_ids)
        assert len(r.prompt_logprobs) == n and torch.isnan(torch.tensor(r.prompt_logprobs[0]))
        expected = logp[: n - 1].gather(-1, tokens[0, 1:n, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.prompt_logprobs[1:]), expected, atol=1e-5, rtol=0)
        assert len(r.prompt_top_logprobs) == n and r.prompt_top_logprobs[0] is None
        values, ids = torch.topk(logp[: n - 1], 2)
        assert [[i for i, _ in row] for row in r.prompt_top_logprobs[1:]] == ids.tolist()
        got = torch.tensor([[v for _, v in row] for row in r.prompt_top_logprobs[1:]])
        torch.testing.assert_close(got, values, atol=1e-5, rtol=0)
        assert len(r.top_logprobs) == len(r.output_ids)
        for step, top in enumerate(r.top_logprobs):
            values, ids = torch.topk(logp[n - 1 + step], 3)
            assert [i for i, _ in top] == ids.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in top]), values, atol=1e-5, rtol=0)


def test_moe_routed_experts_match_a_recorded_full_forward() -> None:
    from furlong.rollout.routing import RoutingRecorder

    model, tokenizer = build_preset("tiny-qwen3-moe", seed=0)
    prompts = [tokenizer("What is 4 + 4?")["input_ids"], tokenizer("Hi")["input_ids"]]
    engine = EmbeddedEngine(model, tokenizer, max_running=2)
    params = never_stop(max_tokens=7, seed=4, return_routed_experts=True)
    results = engine.generate(prompts, params)
    recorder = RoutingRecorder(model)
    for r in results:
        tokens = r.prompt_ids + r.output_ids
        with torch.no_grad(), recorder.record():
            model(torch.tensor([tokens]))
        full = recorder.rows(1)[0]  # [len(tokens), layers, top_k]
        assert r.routed_experts.dtype == torch.int32
        assert r.routed_experts.shape == (len(tokens) - 1, 2, 2)
        # same experts, order within the top-k aside
        assert torch.equal(r.routed_experts.sort(-1).values, full[:-1].sort(-1).values)

    start = len(prompts[0]) - 1  # incremental: only rows from the offset on
    (tail,) = engine.generate(
        prompts[:1],
        never_stop(max_tokens=7, seed=4, return_routed_experts=True, routed_experts_start=start),
    )
    assert tail.routed_experts_start == start
    assert torch.equal(tail.routed_experts, results[0].routed_experts[start:])


def test_routed_experts_need_a_moe_model(setup) -> None:
    model, tokenizer, prompts = setup
    with pytest.raises(InputError, match="no MoE routers"):
        EmbeddedEngine(model, tokenizer).generate(
            prompts[:1], SamplingParams(return_routed_experts=True)
        )
