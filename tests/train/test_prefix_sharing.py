"""Shared-prefix passes equal the plain pass: log-probs, losses and gradients, for groups of
datums sharing prompts of different lengths, a datum sharing nothing, dense and MoE."""

from __future__ import annotations

import pytest
import torch

from furlong.train.prefix_sharing import plan_prefixes
from furlong.types import Datum

from .helpers import assert_close_dicts, engine, grads


def _groups(seed: int) -> list[Datum]:
    """Two prompts (13 and 9 tokens) with 3 and 2 sampled continuations each, plus a loner."""
    g = torch.Generator().manual_seed(seed)
    datums = []
    for prompt_len, samples in ((13, 3), (9, 2), (6, 1)):
        prompt = torch.randint(3, 700, (prompt_len,), generator=g)
        for _ in range(samples):
            response = torch.randint(
                3, 700, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g
            )
            tokens = torch.cat([prompt, response])
            n = len(tokens) - 1
            inputs = {
                "target_tokens": tokens[1:],
                "logprobs": -torch.rand(n, generator=g) * 3 - 5,
                "advantages": torch.randn(n, generator=g),
            }
            datums.append(Datum(tokens[:-1], inputs))
    return datums


def test_the_plan_shares_each_prompt_once() -> None:
    datums = _groups(0)
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
    datums = _groups(1)
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
