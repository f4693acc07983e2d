"""Strict losses at the engine: unknown config keys, out-of-range inputs and non-finite losses
are refused with an error naming the field and datum, and a refused call applies nothing (its
gradients are dropped, so the next optim_step is the one a run without it takes)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from furlong.errors import InputError
from furlong.train.validation import LOGPROB_FLOOR, MAX_MAGNITUDE
from furlong.types import AdamParams, Datum
from tests.train.helpers import engine, grads, params, random_datums

pytestmark = pytest.mark.usefixtures("one_thread")
ADAM = AdamParams(learning_rate=1e-2)


def put(data: list[Datum], i: int, key: str, t: int, value: float) -> list[Datum]:
    """``data`` with ``loss_fn_inputs[key][t]`` of datum ``i`` set to ``value``."""
    inputs = dict(data[i].loss_fn_inputs)
    inputs[key] = inputs[key].clone()
    inputs[key][t] = value
    return [*data[:i], Datum(data[i].model_input, inputs), *data[i + 1 :]]


def f32(x: float) -> float:
    """What a float input holds once it is a float32 tensor (how errors print it)."""
    return float(torch.tensor(x, dtype=torch.float32))


def rl(loss_fn: str = "ppo") -> list[Datum]:
    return random_datums([5, 6, 7, 8], loss_fn, seed=3)


# (id, loss_fn, config, data, the error's exact start)
REFUSALS: list[tuple[str, str, dict | None, Callable[[], list[Datum]], str]] = [
    (
        "config-typo",
        "ppo",
        {"clip_lo": 0.5},
        rl,
        "loss_fn_config: unknown key 'clip_lo' for 'ppo'; expected a subset of "
        "['clip_high_threshold', 'clip_low_threshold']",
    ),
    (
        "logprob-positive",
        "importance_sampling",
        None,
        lambda: put(rl("importance_sampling"), 3, "logprobs", 5, 12.0),
        "datum 3: loss_fn_inputs['logprobs'][5] = 12.0: a log-probability must be <= 0",
    ),
    (
        "logprob-sentinel",  # exp(lp + 1e30) is inf: not a sampler's log-prob
        "importance_sampling",
        None,
        lambda: put(rl("importance_sampling"), 1, "logprobs", 2, -1e30),
        f"datum 1: loss_fn_inputs['logprobs'][2] = {f32(-1e30)}: below -745.0",
    ),
    (
        "ppo-advantage-huge",
        "ppo",
        None,
        lambda: put(rl(), 2, "advantages", 4, -3e38),
        f"datum 2: loss_fn_inputs['advantages'][4] = {f32(-3e38)}: |advantages| must be "
        "<= 1e+06 so the float32 loss cannot overflow",
    ),
    (
        "dro-advantage-huge",
        "dro",
        None,
        lambda: put(rl("dro"), 0, "advantages", 1, 2e7),
        "datum 0: loss_fn_inputs['advantages'][1] = 20000000.0: |advantages| must be <= 1e+06",
    ),
    (
        "ce-weight-huge",
        "cross_entropy",
        None,
        lambda: put(random_datums([4, 5]), 1, "weights", 3, -3e38),
        f"datum 1: loss_fn_inputs['weights'][3] = {f32(-3e38)}: |weights| must be <= 1e+06",
    ),
    (
        "advantage-nan",
        "cispo",
        None,
        lambda: put(rl("cispo"), 1, "advantages", 3, math.nan),
        "datum 1: loss_fn_inputs['advantages'] holds NaN or inf (at [3])",
    ),
    ("stable_reinforce", "stable_reinforce", None, rl, "loss_fn: 'stable_reinforce' is not"),
    ("custom", "custom", None, rl, "loss_fn: 'custom' is not supported by furlong"),
]


@pytest.fixture(scope="module")
def trained():
    e = engine()
    e.forward_backward(random_datums([5, 7, 3]), "cross_entropy")  # accumulated gradients
    return e


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
@pytest.mark.parametrize("op", ["forward_backward", "forward"])
def test_refusals_name_the_field_and_change_nothing(trained, case, op: str) -> None:
    _, loss_fn, config, data, message = case
    before_params, before_grads = params(trained), grads(trained)
    with pytest.raises(InputError) as info:
        getattr(trained, op)(data(), loss_fn, config)
    assert str(info.value).startswith(message)
    assert all(torch.equal(before_params[n], p) for n, p in params(trained).items())
    assert all(torch.equal(before_grads[n], g) for n, g in grads(trained).items())


def test_the_bounds_themselves_are_accepted(trained) -> None:
    data = put(rl("dro"), 0, "logprobs", 0, 0.0)
    data = put(data, 1, "logprobs", 1, LOGPROB_FLOOR)
    data = put(data, 2, "advantages", 2, -MAX_MAGNITUDE)
    assert math.isfinite(trained.forward(data, "dro").metrics["loss:sum"])
    ce = put(random_datums([4]), 0, "weights", 0, MAX_MAGNITUDE)
    assert math.isfinite(trained.forward(ce, "cross_entropy").metrics["loss:sum"])


def overflowing(loss_fn: str, lengths: list[int], i: int, t: int) -> list[Datum]:
    """Datum ``i``'s token ``t`` with sampler log-prob -700 (within the floor) and advantage
    -1: the trainer's lp is far above -700 + 88.73, so r = exp(lp + 700) passes float32's
    3.4e38 and is inf; -r A (importance_sampling) and -min(r A, 1.2 A) (ppo) are +inf."""
    return put(
        put(random_datums(lengths, loss_fn, seed=4), i, "logprobs", t, -700.0),
        i,
        "advantages",
        t,
        -1.0,
    )


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo"])
def test_a_non_finite_loss_is_refused_naming_the_datum(trained, loss_fn: str) -> None:
    before_grads = grads(trained)
    for op in (trained.forward, trained.forward_backward):
        with pytest.raises(InputError) as info:
            op(overflowing(loss_fn, [5, 6, 4], 1, 2), loss_fn)
        assert str(info.value).startswith(f"datum 1: the {loss_fn} loss is inf (float32 overflow")
    assert all(torch.equal(before_grads[n], g) for n, g in grads(trained).items())


def test_finite_datum_losses_whose_sum_overflows_are_refused_as_loss_sum() -> None:
    e = engine()
    data = random_datums([4, 5], "importance_sampling", seed=6)
    lp = [out["logprobs"] for out in e.forward(data, "importance_sampling").outputs]
    # token 0 of each datum: s = lp - ln(2e32), A = -1e6, other advantages 0, so each datum's
    # loss is -r A = 2e32 * 1e6 = 2e38 (finite) and the two sum to 4e38 > 3.4e38 in float32
    for i in (0, 1):
        inputs = dict(data[i].loss_fn_inputs)
        inputs["logprobs"] = inputs["logprobs"].clone()
        inputs["logprobs"][0] = float(lp[i][0]) - math.log(2e32)
        inputs["advantages"] = torch.zeros(len(lp[i]))
        inputs["advantages"][0] = -MAX_MAGNITUDE
        data[i] = Datum(data[i].model_input, inputs)
    with pytest.raises(InputError) as info:
        e.forward_backward(data, "importance_sampling")
    assert str(info.value).startswith("loss:sum: the importance_sampling losses of the datums")
    assert all(p.grad is None for p in e.params)


def test_a_refused_ppo_call_leaves_the_next_step_as_if_it_never_came() -> None:
    """The refused call's first microbatch (datum 2, 8 tokens, finite) ran its backward
    before the second ([6, 4]: datum 1 overflows) did; both are dropped, and the gradients
    pending from before are kept bit for bit."""
    first, last = random_datums([5, 7], "ppo", seed=1), random_datums([3, 6], "ppo", seed=2)
    bad = overflowing("ppo", [6, 4, 8], 1, 2)
    with_refusal, without = (
        engine(max_tokens_per_microbatch=12),
        engine(max_tokens_per_microbatch=12),
    )
    with_refusal.forward_backward(first, "ppo")
    pending = grads(with_refusal)
    with pytest.raises(InputError, match="datum 1: the ppo loss is inf"):
        with_refusal.forward_backward(bad, "ppo")
    assert all(torch.equal(pending[n], g) for n, g in grads(with_refusal).items())
    with_refusal.forward_backward(last, "ppo")
    stepped = with_refusal.optim_step(ADAM)
    assert stepped["skipped_nonfinite:sum"] == 0.0

    without.forward_backward(first, "ppo")
    without.forward_backward(last, "ppo")
    without.optim_step(ADAM)
    a, b = params(with_refusal), params(without)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], p) for n, p in params(engine()).items())  # it did step


def test_a_refused_first_call_leaves_no_gradients() -> None:
    e = engine(max_tokens_per_microbatch=12)
    with pytest.raises(InputError, match="datum 1: the ppo loss is inf"):
        e.forward_backward(overflowing("ppo", [6, 4, 8], 1, 2), "ppo")
    assert all(p.grad is None for p in e.params)
