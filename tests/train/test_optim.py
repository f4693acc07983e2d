"""optim_step: torch.optim.AdamW semantics with per-step AdamParams, global-norm clipping,
the non-finite veto, and zeroed gradients afterwards."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from furlong.errors import InputError
from furlong.types import AdamParams
from tests.train.helpers import engine, grads, params, random_datums

ADAM = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1)


def reference_step(model: torch.nn.Module, g: dict[str, torch.Tensor], adam: AdamParams, steps=1):
    """Independent: torch.optim.AdamW (optionally with clip_grad_norm_) on a copy."""
    ref = copy.deepcopy(model)
    named = dict(ref.named_parameters())
    opt = torch.optim.AdamW(
        named.values(),
        lr=adam.learning_rate,
        betas=(adam.beta1, adam.beta2),
        eps=adam.eps,
        weight_decay=adam.weight_decay,
    )
    for _ in range(steps):
        for n, p in named.items():
            p.grad = g[n].clone()
        if adam.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(named.values(), adam.grad_clip_norm)
        opt.step()
    return {n: p.detach() for n, p in named.items()}


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_step_equals_torch_adamw(clip: float) -> None:
    e = engine()
    e.forward_backward(random_datums([6, 4]), "cross_entropy")
    adam = AdamParams(**{**ADAM.__dict__, "grad_clip_norm": clip})
    g = grads(e)
    norm = math.sqrt(sum(float((t.double() ** 2).sum()) for t in g.values()))
    expected = reference_step(e.model, g, adam)
    metrics = e.optim_step(adam)
    assert metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-5)  # pre-clip norm
    assert metrics["skipped_nonfinite:sum"] == 0.0 and metrics["step:max"] == 1.0
    if clip:
        assert norm > clip  # the clip really acted
    for n, p in zip(e.param_names, e.params, strict=True):
        torch.testing.assert_close(p.detach(), expected[n], atol=0, rtol=0, msg=n)
        assert p.grad is None  # gradients are zeroed after the step


def test_adam_params_apply_to_one_step_only() -> None:
    e = engine()
    e.forward_backward(random_datums([5]), "cross_entropy")
    e.optim_step(AdamParams(learning_rate=1e-2))
    for group in e.optimizer.param_groups:
        assert group["lr"] == 1e-2
    before = params(e)
    e.forward_backward(random_datums([5], seed=1), "cross_entropy")
    e.optim_step(AdamParams(learning_rate=0.0))
    after = params(e)
    assert all(torch.equal(before[n], after[n]) for n in before)  # lr 0, no weight decay


def test_nonfinite_gradient_vetoes_the_update() -> None:
    e = engine()
    e.forward_backward(random_datums([5]), "cross_entropy")
    e.optim_step(ADAM)
    steps_before = {id(p): float(s["step"]) for p, s in e.optimizer.state.items()}
    e.forward_backward(random_datums([5], seed=2), "cross_entropy")
    e.params[3].grad[0, 0] = float("nan")
    before = params(e)
    metrics = e.optim_step(ADAM)
    assert metrics["skipped_nonfinite:sum"] == 1.0 and math.isnan(metrics["grad_norm:mean"])
    assert metrics["step:max"] == 1.0
    after = params(e)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert all(p.grad is None for p in e.params)
    assert {id(p): float(s["step"]) for p, s in e.optimizer.state.items()} == steps_before


def test_step_without_gradients_is_harmless() -> None:
    e = engine()
    before = params(e)
    metrics = e.optim_step(AdamParams(learning_rate=1e-2))
    assert metrics["grad_norm:mean"] == 0.0
    assert all(torch.equal(before[n], p) for n, p in params(e).items())


@pytest.mark.parametrize(
    "field, value",
    [
        ("learning_rate", -1.0),
        ("beta1", 1.0),
        ("beta2", 1.5),
        ("eps", float("nan")),
        ("weight_decay", float("inf")),
        ("grad_clip_norm", -0.1),
        ("learning_rate", "0.1"),
    ],
)
def test_adam_params_are_validated(field: str, value: object) -> None:
    with pytest.raises(InputError, match=field):
        AdamParams(**{field: value})
