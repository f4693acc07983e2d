"""MoE routing replay in the trainer: rollout routes reproduce the rollout's log-probs, forced
routes equal an independent masked-logits computation (values and gradients), bad routes are
rejected before anything runs."""

from __future__ import annotations

import copy

import pytest
import torch

from furlong.errors import InputError
from furlong.models.moe import find_routers
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sampling import SamplingParams
from furlong.types import Datum

from .helpers import assert_close_dicts, engine, grads, random_datums, sequence_datum

MOE = "tiny-qwen3-moe"


def _routes_shape(e) -> tuple[int, int, int]:
    routers = find_routers(e.model)
    return len(routers), routers[0].top_k, routers[0].num_experts


def _random_routes(datums: list[Datum], layers: int, k: int, experts: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(len(d) * layers)])
        .view(len(d), layers, k)
        .to(torch.int32)
        for d in datums
    ]


def _ce(datums: list[Datum]) -> list[Datum]:
    return [Datum(d.model_input, {**d.loss_fn_inputs}) for d in datums]


def test_rollout_routes_reproduce_the_rollouts_logprobs() -> None:
    trainer = engine(MOE)
    rollout = EmbeddedEngine(copy.deepcopy(trainer.model), trainer.tokenizer)
    prompts = [[5, 17, 42, 99, 7], [300, 12, 8]]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, return_routed_experts=True)
    results = rollout.generate(prompts, [params] * 2)
    datums, routes = [], []
    for r in results:
        tokens = r.prompt_ids + r.output_ids
        datums.append(sequence_datum(tokens, len(r.output_ids)))
        routes.append(r.routed_experts)
        assert r.routed_experts.shape[0] == len(tokens) - 1
    out = trainer.forward(datums, "cross_entropy", routed_experts=routes)
    for o, r in zip(out.outputs, results, strict=True):
        got = o["logprobs"][-len(r.output_ids) :]
        assert torch.allclose(got, torch.tensor(r.output_logprobs), atol=1e-5)


def test_replaying_the_models_own_choice_changes_nothing() -> None:
    e = engine(MOE)
    datums = random_datums([7, 4, 9], seed=1)
    plain = e.forward(datums, "cross_entropy")
    # record what the trainer's own routers choose on these inputs, one datum at a time
    recorded = []
    for d in datums:
        layers: list[torch.Tensor] = []

        def keep(_m, _i, out, layers=layers) -> None:
            layers.append(out[2])

        handles = [r.register_forward_hook(keep) for r in find_routers(e.model)]
        with torch.no_grad():
            e.model(input_ids=torch.as_tensor(d.model_input).view(1, -1))
        for h in handles:
            h.remove()
        recorded.append(torch.stack(layers, dim=1))
    replayed = e.forward(datums, "cross_entropy", routed_experts=recorded)
    for a, b in zip(plain.outputs, replayed.outputs, strict=True):
        assert torch.allclose(a["logprobs"], b["logprobs"], atol=1e-6)


def _masked_router_forward(router: torch.nn.Module, forced: torch.Tensor):
    """An independent router: logits outside the forced set are -inf, so softmax + top-k pick
    exactly the forced experts with their renormalized probabilities (norm_topk_prob)."""

    def forward(hidden: torch.Tensor):
        hidden = hidden.reshape(-1, router.hidden_dim)
        logits = torch.nn.functional.linear(hidden, router.weight)
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, forced, True)
        probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
        top, idx = torch.topk(probs, router.top_k, dim=-1)
        return logits, top, idx

    return forward


@pytest.mark.parametrize("checkpointing", [False, True])
def test_forced_routes_equal_masked_logits(checkpointing: bool) -> None:
    datums = random_datums([6, 6], loss_fn="importance_sampling", seed=2)
    replay = engine(MOE, gradient_checkpointing=checkpointing)
    assert all(r.norm_topk_prob for r in find_routers(replay.model))
    layers, k, experts = _routes_shape(replay)
    routes = _random_routes(datums, layers, k, experts, seed=4)

    plain = replay.forward(datums, "importance_sampling")
    got = replay.forward_backward(datums, "importance_sampling", routed_experts=routes)
    got_grads = grads(replay)

    reference = engine(MOE)
    # both datums have 6 positions, so one microbatch lays them out as [2 * 6] rows
    flat = torch.cat(routes).to(torch.int64)  # [12, layers, k]
    for layer, router in enumerate(find_routers(reference.model)):
        router.forward = _masked_router_forward(router, flat[:, layer])
    want = reference.forward_backward(datums, "importance_sampling")

    for a, b, p in zip(got.outputs, want.outputs, plain.outputs, strict=True):
        assert torch.allclose(a["logprobs"], b["logprobs"], atol=1e-5)
        assert (a["logprobs"] - p["logprobs"]).abs().max() > 1e-3  # forcing moved them
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
    assert_close_dicts(grads(reference), got_grads, rel=1e-4)
    router_grads = [n for n in got_grads if n.endswith("mlp.gate.weight")]
    assert router_grads and all(got_grads[n].abs().sum() > 0 for n in router_grads)


def test_datums_without_routes_keep_their_own_choice() -> None:
    e = engine(MOE)
    datums = random_datums([5, 8], seed=5)
    layers, k, experts = _routes_shape(e)
    routes = _random_routes(datums[:1], layers, k, experts, seed=6)
    plain = e.forward(datums, "cross_entropy")
    mixed = e.forward(datums, "cross_entropy", routed_experts=[routes[0], None])
    alone = e.forward(datums[:1], "cross_entropy", routed_experts=routes)
    assert torch.allclose(mixed.outputs[1]["logprobs"], plain.outputs[1]["logprobs"], atol=1e-6)
    assert torch.allclose(mixed.outputs[0]["logprobs"], alone.outputs[0]["logprobs"], atol=1e-6)


def test_bad_routes_are_rejected_before_compute() -> None:
    e = engine(MOE)
    datums = random_datums([4, 5], seed=7)
    layers, k, experts = _routes_shape(e)
    good = _random_routes(datums, layers, k, experts, seed=8)
    short = [good[0], good[1][:-1]]
    high = [good[0], good[1].clone()]
    high[1][2, 0, 0] = experts
    repeated = [good[0], good[1].clone()]
    repeated[1][0, 1] = repeated[1][0, 1, 0]
    cases = [
        (short, r"routed_experts\[1\]: shape"),
        (high, r"routed_experts\[1\]: expert ids must be in"),
        (repeated, r"routed_experts\[1\]: an expert is repeated"),
        ([good[0].float(), good[1]], r"routed_experts\[0\]: expected integer"),
        (good[:1], r"routed_experts: 1 entries for 2 datums"),
    ]
    for routes, message in cases:
        with pytest.raises(InputError, match=message):
            e.forward_backward(datums, "cross_entropy", routed_experts=routes)
        assert all(p.grad is None for p in e.params)
    dense = engine("tiny-qwen3")
    with pytest.raises(InputError, match="no MoE routers"):
        dense.forward(random_datums([3]), "cross_entropy", routed_experts=[None])


def test_a_microbatch_without_routes_runs_unforced() -> None:
    """Routes for one datum only, and a token budget that puts the other datum in its own
    microbatch: that microbatch runs on the router's own choice."""
    e = engine(MOE, max_tokens_per_microbatch=9)
    datums = random_datums([9, 4], seed=9)
    layers, k, experts = _routes_shape(e)
    routes = _random_routes(datums[:1], layers, k, experts, seed=10)
    plain = e.forward(datums, "cross_entropy")
    mixed = e.forward(datums, "cross_entropy", routed_experts=[routes[0], None])
    assert torch.allclose(mixed.outputs[1]["logprobs"], plain.outputs[1]["logprobs"], atol=1e-6)
    assert (mixed.outputs[0]["logprobs"] - plain.outputs[0]["logprobs"]).abs().max() > 1e-3
