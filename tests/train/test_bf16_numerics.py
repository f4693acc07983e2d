"""A bf16 model against the same weights in fp32: log-probs, losses and gradients within stated
bounds, and the temperature divides the logits after they are upcast to fp32.

The bounds are ~3x what was measured (2026-12-06, AMX and emulated bf16 alike): bf16 keeps 8
bits of mantissa, so each matmul's output carries ~2^-9 relative rounding and a log-prob of
magnitude ~7 (random weights, vocab 1000) moves by a few thousandths of a nat; on SmolLM2's
peaked real distributions the mean moves 0.035-0.043 nats (benchmarks note, not a test: its
bf16 pass is ~10x slower where bf16 is emulated).
"""

from __future__ import annotations

import copy

import pytest
import torch

from furlong.models.loading import load_model
from furlong.train.engine import TrainingEngine
from tests.train.helpers import random_datums

BOUNDS = {  # measured on tiny-qwen3: lp max 0.0043, mean 0.0010; grad rel 0.0094-0.0097
    "lp_max": 0.015,
    "lp_mean": 0.004,
    "grad_rel": 0.03,
}


def _pair() -> tuple[TrainingEngine, TrainingEngine]:
    fp32, tokenizer = load_model("tiny-qwen3", seed=0)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    return TrainingEngine(fp32, tokenizer), TrainingEngine(bf16, tokenizer)


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo"])
def test_bf16_logprobs_losses_and_gradients_stay_within_bounds(loss_fn: str) -> None:
    full, half = _pair()
    datums = random_datums([40, 33, 20], loss_fn, seed=3)
    a = full.forward_backward(datums, loss_fn)
    b = half.forward_backward(datums, loss_fn)
    lp_a = torch.cat([o["logprobs"] for o in a.outputs])
    lp_b = torch.cat([o["logprobs"] for o in b.outputs])
    assert lp_b.dtype == torch.float32
    gap = (lp_a - lp_b).abs()
    assert float(gap.max()) <= BOUNDS["lp_max"] and float(gap.mean()) <= BOUNDS["lp_mean"]
    assert float(gap.max()) > 0  # the two really ran in different precisions
    # each loss is a sum of per-token terms, each moved by at most lp_max (ppo/IS: times a
    # ratio near 1 and an advantage, |A| < 4 here)
    tokens = sum(len(d) for d in datums)
    assert abs(a.metrics["loss:sum"] - b.metrics["loss:sum"]) <= 4 * BOUNDS["lp_mean"] * tokens
    g_a = torch.cat([p.grad.flatten() for p in full.params]).double()
    g_b = torch.cat([p.grad.flatten() for p in half.params]).double()  # the fp32 masters' grads
    assert float((g_a - g_b).norm() / g_a.norm()) <= BOUNDS["grad_rel"]


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_temperature_divides_the_logits_after_the_fp32_upcast(temperature: float) -> None:
    """Independent: the bf16 model's own logits, upcast, divided, full log-softmax. Dividing in
    bf16 first would round the scaled logits again (detectably: checked below)."""
    _, half = _pair()
    d = random_datums([24], seed=5)[0]
    got = half.forward([d], "cross_entropy", temperature=temperature).outputs[0]["logprobs"]
    with torch.no_grad():
        logits = half.model(d.model_input.unsqueeze(0)).logits[0]
    targets = d.loss_fn_inputs["target_tokens"].unsqueeze(-1)

    def logprobs(scaled: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(scaled, -1).gather(-1, targets).squeeze(-1)

    after = logprobs(logits.float() / temperature)
    before = logprobs((logits / temperature).float())
    torch.testing.assert_close(got, after, atol=1e-5, rtol=0)
    assert float((before - after).abs().max()) > 1e-4  # the order is observable
