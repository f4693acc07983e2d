"""TrainingEngine: outputs against an independent HF computation, raw-sum semantics,
microbatching, accumulation, recompute, forward-only, and the padding-only microbatch."""

from __future__ import annotations

import pytest
import torch

from furlong.train import engine as engine_module
from furlong.train.batching import PADDING, collate
from furlong.train.objectives import get_objective
from furlong.types import Datum
from tests.train.helpers import assert_close_dicts, engine, grads, random_datums

LOSSES = ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]


def hf_logprobs(e, d: Datum, temperature: float = 1.0) -> torch.Tensor:
    """Independent: the HF model's own logits, full log-softmax in fp32."""
    with torch.no_grad():
        logits = e.model(d.model_input.unsqueeze(0)).logits[0].float() / temperature
    targets = d.loss_fn_inputs["target_tokens"]
    logp = torch.log_softmax(logits, -1)
    if targets.dim() == 1:
        return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp.gather(-1, targets)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_outputs_match_independent_hf_computation(preset: str) -> None:
    e = engine(preset, max_tokens_per_microbatch=20)
    data = random_datums([7, 3, 11, 5])
    result = e.forward(data, "cross_entropy")
    assert len(result.outputs) == len(data)
    total = 0.0
    for d, out in zip(data, result.outputs, strict=True):
        lp = hf_logprobs(e, d)
        torch.testing.assert_close(out["logprobs"], lp, atol=1e-5, rtol=0)
        expected = -(d.loss_fn_inputs["weights"] * lp).sum()
        torch.testing.assert_close(out["loss"], expected, atol=1e-5, rtol=1e-6)
        assert out["logprobs"].dtype == torch.float32 and not out["logprobs"].requires_grad
        assert out["loss"].dim() == 0 and out["loss"].device.type == "cpu"
        total += float(out["loss"])
    assert result.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)


def test_temperature_scales_logits_before_softmax() -> None:
    e = engine()
    data = random_datums([6, 4])
    result = e.forward(data, "cross_entropy", temperature=0.7)
    for d, out in zip(data, result.outputs, strict=True):
        torch.testing.assert_close(out["logprobs"], hf_logprobs(e, d, 0.7), atol=1e-5, rtol=0)


def test_top_k_cross_entropy_targets() -> None:
    e = engine()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 700, (6,), generator=g)
    targets = torch.randint(3, 700, (6, 3), generator=g)
    weights = torch.rand(6, 3, generator=g)
    d = Datum(ids, {"target_tokens": targets, "weights": weights})
    out = e.forward([d], "cross_entropy").outputs[0]
    lp = hf_logprobs(e, d)
    assert out["logprobs"].shape == (6, 3)
    torch.testing.assert_close(out["logprobs"], lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(out["loss"], -(weights * lp).sum(), atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_forward_equals_forward_backward_and_keeps_grads(loss_fn: str) -> None:
    e = engine()
    data = random_datums([5, 8, 3], loss_fn)
    e.forward_backward(random_datums([4], loss_fn, seed=9), loss_fn)
    before = grads(e)
    fwd = e.forward(data, loss_fn)
    after_forward = grads(e)
    for k in before:
        assert torch.equal(before[k], after_forward[k]), k
    fb = e.forward_backward(data, loss_fn)
    assert fwd.metrics["loss:sum"] == fb.metrics["loss:sum"]
    for a, b in zip(fwd.outputs, fb.outputs, strict=True):
        assert torch.equal(a["logprobs"], b["logprobs"]) and torch.equal(a["loss"], b["loss"])


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo"])
def test_microbatch_budget_never_changes_results(loss_fn: str) -> None:
    data = random_datums([9, 2, 14, 5, 7, 7], loss_fn)
    runs = []
    for budget in (0, 1, 16, 30):
        e = engine(max_tokens_per_microbatch=budget)
        result = e.forward_backward(data, loss_fn)
        runs.append((result, grads(e)))
    ref, ref_grads = runs[0]
    for result, g in runs[1:]:
        assert result.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-6)
        for a, b in zip(ref.outputs, result.outputs, strict=True):
            torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=1e-6, rtol=0)
        # gradients are fp32 sums over a different number of microbatches; the kernels picked
        # for each shape differ by CPU, so allow a few ulps of the largest entry
        assert_close_dicts(ref_grads, g, rel=5e-6)


def test_gradients_are_the_plain_sum_over_datums() -> None:
    """Raw sums: the gradient of a batch equals the sum of single-datum gradients, not a mean."""
    data = random_datums([4, 6, 3], "importance_sampling")
    e = engine()
    e.forward_backward(data, "importance_sampling")
    together = grads(e)
    summed = None
    for d in data:
        single = engine()
        single.forward_backward([d], "importance_sampling")
        g = grads(single)
        summed = g if summed is None else {k: summed[k] + g[k] for k in g}
    assert_close_dicts(together, summed, rel=1e-5)


def test_chunk_additive_accumulation_and_step() -> None:
    data = random_datums([5, 9, 4, 6], "cispo")
    whole = engine()
    r_all = whole.forward_backward(data, "cispo")
    parts = engine()
    r_a = parts.forward_backward(data[:1], "cispo")
    r_b = parts.forward_backward(data[1:3], "cispo")
    r_c = parts.forward_backward(data[3:], "cispo")
    split_sum = r_a.metrics["loss:sum"] + r_b.metrics["loss:sum"] + r_c.metrics["loss:sum"]
    assert split_sum == pytest.approx(r_all.metrics["loss:sum"], rel=1e-6)
    assert_close_dicts(grads(whole), grads(parts))
    whole.optim_step()
    parts.optim_step()
    for a, b in zip(whole.params, parts.params, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_loss_recompute_yields_one_output_per_datum(monkeypatch: pytest.MonkeyPatch) -> None:
    data = random_datums([6, 3, 8], "ppo")
    plain = engine(max_tokens_per_microbatch=16)
    ref = plain.forward_backward(data, "ppo")

    calls = {"n": 0}
    original = engine_module.TrainingEngine._loss

    def counting(self, hidden, **kw):
        calls["n"] += 1
        return original(self, hidden, **kw)

    monkeypatch.setattr(engine_module.TrainingEngine, "_loss", counting)
    e = engine(max_tokens_per_microbatch=16, recompute_loss=True)
    first = e.forward_backward(data, "ppo")
    microbatches = calls["n"] // 2
    assert calls["n"] == 2 * microbatches and microbatches >= 2  # forward + recompute
    second = e.forward_backward(data[:1], "ppo")
    assert len(first.outputs) == 3 and len(second.outputs) == 1  # calls are isolated
    for a, b in zip(ref.outputs, first.outputs, strict=True):
        assert torch.equal(a["logprobs"], b["logprobs"]) and torch.equal(a["loss"], b["loss"])
    fresh = engine(max_tokens_per_microbatch=16, recompute_loss=True)
    fresh.forward_backward(data, "ppo")
    assert_close_dicts(grads(plain), grads(fresh), rel=1e-7)


def test_padding_only_microbatch_is_a_connected_fp32_zero() -> None:
    e = engine()
    objective = get_objective("cross_entropy")
    pad = random_datums([4])
    mb = collate(pad, [PADDING], objective.inputs)
    total, results = e.run_microbatch(mb, objective, {}, 1.0, backward=True)
    assert total == 0.0 and results == []
    g = grads(e)
    assert all(torch.isfinite(t).all() and not t.any() for t in g.values())
    assert e.model.get_output_embeddings().weight.grad is not None  # graph stayed connected


def test_padding_datums_add_nothing_to_real_ones() -> None:
    e = engine()
    objective = get_objective("dro")
    cfg = objective.resolve_config(None)
    real, pad = random_datums([5, 3], "dro")
    total_mixed, results = e.run_microbatch(
        collate([real, pad], [0, PADDING], objective.inputs), objective, cfg, 1.0, True
    )
    mixed = grads(e)
    alone = engine()
    total_alone, _ = alone.run_microbatch(
        collate([real], [0], objective.inputs), objective, cfg, 1.0, True
    )
    assert [i for i, _ in results] == [0]
    assert total_mixed == pytest.approx(total_alone, rel=1e-6)
    assert_close_dicts(mixed, grads(alone))


def test_padding_only_microbatch_with_fp16_logits_stays_finite() -> None:
    """fp16 logits whose half-precision sum overflows: the placeholder is still exactly 0."""
    e = engine()
    e.model.half()
    head = e.model.get_output_embeddings()
    with torch.no_grad():
        head.weight.fill_(60.0)
    objective = get_objective("cross_entropy")
    mb = collate(random_datums([4]), [PADDING], objective.inputs)
    with torch.no_grad():
        logits = head(e._hidden_rows(mb)[:1])
    assert torch.isinf(logits.sum())  # the naive fp16 placeholder would be 0 * inf = NaN
    total, results = e.run_microbatch(mb, objective, {}, 1.0, backward=True)
    assert total == 0.0 and results == []
    assert head.weight.grad is not None
    assert all(torch.isfinite(p.grad).all() for p in e.params if p.grad is not None)


def test_trunk_activation_checkpointing_keeps_results() -> None:
    data = random_datums([6, 9], "dro")
    plain, ckpt = engine(), engine(gradient_checkpointing=True)
    a = plain.forward_backward(data, "dro")
    b = ckpt.forward_backward(data, "dro")
    for x, y in zip(a.outputs, b.outputs, strict=True):
        torch.testing.assert_close(x["logprobs"], y["logprobs"], atol=1e-6, rtol=0)
    assert_close_dicts(grads(plain), grads(ckpt))


def test_model_precision_engine_reports_fp32_logprobs() -> None:
    """A bf16 model: outputs are fp32 and match the bf16 model's own logits upcast to fp32."""
    e = engine()
    e.model.to(torch.bfloat16)
    d = random_datums([5])[0]
    out = e.forward([d], "cross_entropy").outputs[0]
    assert out["logprobs"].dtype == torch.float32
    torch.testing.assert_close(out["logprobs"], hf_logprobs(e, d), atol=1e-6, rtol=0)
