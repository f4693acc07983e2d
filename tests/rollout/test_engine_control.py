"""Engine control while requests are in flight: pause modes (abort / retract / in_place),
weight updates between steps, aborting by id, and the offload/onload memory API.

The oracle is an independent full forward of the same tokens (fresh cache) under the weights
in force, so each mode's effect on the log-probs is visible: retract recomputes the prefix
under the new weights, in_place keeps the stale cache."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from furlong.errors import InputError
from furlong.models import build_preset
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

LONG = SamplingParams(max_tokens=240, seed=3, stop_token_ids=())


@pytest.fixture()
def setup():
    model, tokenizer = build_preset("tiny-qwen3", seed=0)
    prompt = tokenizer("What is 2 + 3?")["input_ids"]
    return model, tokenizer, prompt


def perturbed(model: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: p.detach() + 0.1 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()
    }


@torch.no_grad()
def full_forward_logprobs(model, weights, prompt, output) -> torch.Tensor:
    """Log-probs of ``output`` under ``weights``, recomputed from scratch (temperature 1)."""
    saved = {n: p.clone() for n, p in model.named_parameters()}
    model.load_state_dict(weights, strict=False)
    try:
        tokens = torch.tensor([prompt + output])
        logp = torch.log_softmax(model(input_ids=tokens).logits[0].float(), dim=-1)
        n = len(prompt)
        return logp[n - 1 : -1].gather(-1, tokens[0, n:].unsqueeze(-1)).squeeze(-1)
    finally:
        model.load_state_dict(saved, strict=False)


def run_steps(engine: EmbeddedEngine, steps: int) -> None:
    """Wait until the engine has run ``steps`` more batch steps."""
    target, deadline = engine.steps + steps, time.monotonic() + 30
    while engine.steps < target:
        assert time.monotonic() < deadline, "engine made no progress"
        time.sleep(0.0005)


def split_point(lp: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> int | None:
    """The k with lp[:k] == old[:k] and lp[k:] == new[k:] (within 1e-5), if any."""
    for k in range(1, len(lp)):
        if torch.allclose(lp[:k], old[:k], atol=1e-5, rtol=0) and torch.allclose(
            lp[k:], new[k:], atol=1e-5, rtol=0
        ):
            return k
    return None


def test_abort_ends_in_flight_and_queued_requests_with_partial_output(setup) -> None:
    model, tokenizer, prompt = setup
    engine = EmbeddedEngine(model, tokenizer, max_running=1)
    (full,) = engine.generate([prompt], LONG)
    first, queued = engine.submit(prompt, LONG), engine.submit(prompt, LONG)
    run_steps(engine, 5)
    engine.pause("abort")
    a, b = first.result(timeout=5), queued.result(timeout=5)
    assert a.finish_reason == "abort" and 0 < len(a.output_ids) < LONG.max_tokens
    assert a.output_ids == full.output_ids[: len(a.output_ids)]  # a prefix of the same draw
    assert len(a.output_logprobs) == len(a.output_ids)
    assert b.finish_reason == "abort" and b.output_ids == []
    engine.resume()
    (again,) = engine.generate([prompt], LONG)
    assert again.output_ids == full.output_ids


def test_retract_recomputes_the_prefix_under_new_weights(setup) -> None:
    model, tokenizer, prompt = setup
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    new = perturbed(model)
    engine = EmbeddedEngine(model, tokenizer)
    future = engine.submit(prompt, LONG)
    run_steps(engine, 5)
    engine.pause("retract")
    assert engine.update_weights(new) == 1
    engine.resume()
    r = future.result(timeout=30)
    assert r.finish_reason == "length" and r.weight_version == 1
    lp = torch.tensor(r.output_logprobs)
    k = split_point(
        lp,
        full_forward_logprobs(model, old, prompt, r.output_ids),
        full_forward_logprobs(model, new, prompt, r.output_ids),
    )
    assert k is not None and k >= 4  # old policy before the pause, exact new policy after


def test_in_place_keeps_the_stale_cache(setup) -> None:
    model, tokenizer, prompt = setup
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    new = perturbed(model)
    engine = EmbeddedEngine(model, tokenizer)
    future = engine.submit(prompt, LONG)
    run_steps(engine, 5)
    engine.pause("in_place")
    engine.update_weights(new)
    engine.resume()
    r = future.result(timeout=30)
    assert r.finish_reason == "length" and len(r.output_ids) == LONG.max_tokens
    lp = torch.tensor(r.output_logprobs)
    old_lp = full_forward_logprobs(model, old, prompt, r.output_ids)
    new_lp = full_forward_logprobs(model, new, prompt, r.output_ids)
    k = next(i for i in range(len(lp)) if abs(lp[i] - old_lp[i]) > 1e-5)
    assert k >= 5  # the frozen prefix was generated by the old weights
    # resumed on the old weights' KV cache: not what a recompute under the new weights gives
    assert split_point(lp, old_lp, new_lp) is None
    assert (lp[k + 1 :] - new_lp[k + 1 :]).abs().max() > 1e-3


def test_requests_wait_while_paused(setup) -> None:
    model, tokenizer, prompt = setup
    engine = EmbeddedEngine(model, tokenizer)
    engine.pause("abort")
    future = engine.submit(prompt, SamplingParams(max_tokens=4, seed=0))
    time.sleep(0.05)
    assert not future.done() and engine.steps == 0
    engine.resume()
    assert len(future.result(timeout=10).output_ids) >= 1


def test_abort_by_request_id_leaves_the_others_alone(setup) -> None:
    model, tokenizer, prompt = setup
    engine = EmbeddedEngine(model, tokenizer)
    params = [SamplingParams(max_tokens=120, seed=i, stop_token_ids=()) for i in range(3)]
    alone = engine.generate([prompt] * 3, params)
    futures = [engine.submit(prompt, p, request_id=f"r{i}") for i, p in enumerate(params)]
    run_steps(engine, 4)
    assert engine.abort(["r1", "missing"]) == 1
    results = [f.result(timeout=30) for f in futures]
    assert results[1].finish_reason == "abort" and results[1].request_id == "r1"
    assert results[1].output_ids == alone[1].output_ids[: len(results[1].output_ids)]
    for i in (0, 2):
        assert results[i].output_ids == alone[i].output_ids
        assert results[i].finish_reason == "length"


def test_bad_pause_mode_and_tags_are_rejected(setup) -> None:
    model, tokenizer, _ = setup
    engine = EmbeddedEngine(model, tokenizer)
    with pytest.raises(InputError, match="mode: 'later'"):
        engine.pause("later")  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"tags\[1\]: 'disk'"):
        engine.offload(["weights", "disk"])  # type: ignore[list-item]
    assert not engine.offloaded and not engine.paused


def test_offload_weights_round_trip_and_update_while_offloaded(setup) -> None:
    model, tokenizer, prompt = setup
    params = SamplingParams(max_tokens=20, seed=1, stop_token_ids=())
    reference = EmbeddedEngine(*build_preset("tiny-qwen3", seed=0), max_running=4)
    new = perturbed(reference.model)
    engine = EmbeddedEngine(model, tokenizer)
    (before,) = engine.generate([prompt], params)

    engine.offload(["weights"])
    assert all(p.numel() == 0 for p in model.parameters())  # released from the model
    with pytest.raises(InputError, match="already offloaded"):
        engine.offload(["weights"])
    waiting = engine.submit(prompt, params)  # waits for onload
    time.sleep(0.05)
    assert not waiting.done()
    engine.onload(["weights"])
    assert waiting.result(timeout=10).output_ids == before.output_ids

    engine.offload(["weights", "kv_cache"])
    engine.update_weights(new)  # lands in the host copy
    engine.onload(["kv_cache", "weights"])
    reference.update_weights(new)
    (ours,), (theirs,) = engine.generate([prompt], params), reference.generate([prompt], params)
    assert ours.output_ids == theirs.output_ids
    with pytest.raises(InputError, match="not offloaded"):
        engine.onload(["weights"])


def test_offload_kv_cache_of_frozen_requests_then_resume(setup) -> None:
    model, tokenizer, prompt = setup
    engine = EmbeddedEngine(model, tokenizer)
    (full,) = engine.generate([prompt], LONG)
    future = engine.submit(prompt, LONG)
    run_steps(engine, 5)
    with pytest.raises(InputError, match="requests are running"):
        engine.offload(["kv_cache"])
    engine.pause("in_place")
    engine.offload(["kv_cache"])
    engine.resume()  # still offloaded: nothing runs
    time.sleep(0.02)
    assert not future.done()
    engine.onload(["kv_cache"])
    r = future.result(timeout=30)
    assert r.output_ids == full.output_ids and r.finish_reason == "length"


def test_update_weights_from_another_thread_lands_between_steps(setup) -> None:
    model, tokenizer, prompt = setup
    engine = EmbeddedEngine(model, tokenizer)
    new = perturbed(model)  # made before the request starts: only the copy races its end
    # as long as the context allows, so that a loaded machine still ends it after the update
    future = engine.submit(prompt, dataclasses.replace(LONG, max_tokens=2000))
    run_steps(engine, 3)
    worker = threading.Thread(target=engine.update_weights, args=(new,))
    worker.start()
    worker.join(timeout=30)
    assert future.result(timeout=30).weight_version == 1
