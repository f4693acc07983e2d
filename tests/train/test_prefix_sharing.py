"""Shared-prefix passes equal the plain pass: log-probs, losses and gradients, for groups of
datums sharing prompts of different lengths, a datum sharing nothing, dense and MoE."""

from __future__ import annotations

import pytest
import torch

from furlong.train.prefix_sharing import plan_prefixes

from .helpers import assert_close_dicts, engine, grads, grouped_datums


def test_the_plan_shares_each_prompt_once() -> None:
    datums = grouped_datums(0)
    lengths = [len(d) for d in datums]
    ids = torch.zeros(len(datums), max(lengths), dtype=torch.long)
    for j, d in enumerate(datums):
        ids[j, : len(d)] = torch.as_tensor(d.model_input)
    plan = plan_prefixes(ids, lengths)
    assert plan is not None
    assert plan.owner.tolist() == [0, 0, 0, 1, 1, 2]
    assert int(plan.prefix_mask[0].sum()) >= 13 and int(plan.prefix_mask[1].sum()) >= 9
    run = int(plan.prefix_mask.sum() + plan.suffix_mask.sum())
    assert run < sum(lengths)  # fewer trunk tokens
    assert plan.rows.numel() == sum(lengths)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_shared_prefix_pass_equals_the_plain_pass(preset: str, monkeypatch) -> None:
    from furlong.train import engine as engine_module

    calls = []
    real = engine_module.shared_prefix_hidden
    monkeypatch.setattr(
        engine_module, "shared_prefix_hidden", lambda *a: calls.append(1) or real(*a)
    )
    datums = grouped_datums(1)
    plain, shared = engine(preset), engine(preset, share_prefixes=True)
    a = plain.forward_backward(datums, "ppo")
    assert not calls
    b = shared.forward_backward(datums, "ppo")
    assert calls  # the shared path ran
    for x, y in zip(a.outputs, b.outputs, strict=True):
        assert torch.allclose(x["logprobs"], y["logprobs"], atol=2e-5)
        assert torch.allclose(x["loss"], y["loss"], atol=2e-5, rtol=1e-5)
    assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-5)
    assert_close_dicts(grads(plain), grads(shared), rel=1e-4)


def test_nothing_to_share_falls_back_to_the_plain_pass() -> None:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 700, (3, 8), generator=g)
    assert plan_prefixes(ids, [8, 8, 8]) is None
