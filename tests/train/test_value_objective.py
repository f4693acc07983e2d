"""The critic: a ValueModel trained by the TrainingEngine with the ``value`` objective. The
clipped value loss by hand, values and gradients against an independent per-datum
computation, microbatch independence, learning, checkpoints, and input validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from furlong.errors import InputError
from furlong.models.critic import critic_from_pretrained
from furlong.rl.config import CriticConfig, RLConfig
from furlong.rl.critic import INFO
from furlong.train.engine import EngineConfig, TrainingEngine
from furlong.train.objectives import value_loss
from furlong.types import AdamParams, Datum
from tests.train.helpers import assert_close_dicts, grads, params

pytestmark = pytest.mark.usefixtures("one_thread")
ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)
LENGTHS = [6, 3, 8]


def make(seed: int = 0, max_tokens_per_microbatch: int = 8192) -> TrainingEngine:
    model = critic_from_pretrained("tiny-qwen3", seed=seed)
    return TrainingEngine(model, None, EngineConfig(max_tokens_per_microbatch))


def batch(lengths: list[int], seed: int = 0) -> tuple[list[Datum], list, list, list]:
    """Datums and nonzero returns / old values / weights (some weights 0, as on prompts)."""
    g = torch.Generator().manual_seed(seed)
    datums, returns, old, weights = [], [], [], []
    for n in lengths:
        ids = torch.randint(3, 700, (n + 1,), generator=g)
        datums.append(Datum(ids[:-1], {"target_tokens": ids[1:]}))
        returns.append(torch.randn(n, generator=g))
        old.append(torch.randn(n, generator=g) * 0.3)
        w = torch.rand(n, generator=g) + 0.5
        w[0] = 0.0
        weights.append(w)
    return datums, returns, old, weights


def with_inputs(datums, returns, old, weights) -> list[Datum]:
    """The value objective's per-token inputs on each datum."""
    return [
        Datum(d.model_input, {**d.loss_fn_inputs, "returns": r, "old_values": o, "weights": w})
        for d, r, o, w in zip(datums, returns, old, weights, strict=True)
    ]


def train(e: TrainingEngine, datums, returns, old, weights, clip: float | None = 0.2) -> dict:
    data = with_inputs(datums, returns, old, weights)
    return e.forward_backward(data, "value", {"value_clip": clip or 0.0}).metrics


def values(e: TrainingEngine, datums: list[Datum]) -> list[torch.Tensor]:
    zeros = [torch.zeros(len(d)) for d in datums]
    out = e.forward(with_inputs(datums, zeros, zeros, zeros), "value")
    return [o["values"] for o in out.outputs]


# ------------------------------------------------------------------- the loss by hand

V = [0.5, 1.0, 1.0, -0.3]
OLD = [0.4, 0.5, 0.5, 0.0]
R = [1.0, 0.0, 2.0, 0.5]
W = [2.0, 1.0, 0.5, 3.0]


def test_clipped_value_loss_by_hand() -> None:
    v = torch.tensor(V, requires_grad=True)
    loss, clipped = value_loss(v, torch.tensor(R), torch.tensor(OLD), torch.tensor(W), 0.2)
    # t0: |v-old| = .1 inside the range, branches equal (.25)        -> 2 * .5 * .25 = .25
    # t1: v_clip = .7, (1-0)^2 = 1 > (.7-0)^2 = .49: unclipped       -> 1 * .5 * 1 = .5
    # t2: v_clip = .7, (1-2)^2 = 1 < (.7-2)^2 = 1.69: clipped        -> .5 * .5 * 1.69 = .4225
    # t3: v_clip = -.2, (-.8)^2 = .64 > (-.7)^2 = .49: unclipped     -> 3 * .5 * .64 = .96
    torch.testing.assert_close(loss, torch.tensor([0.25, 0.5, 0.4225, 0.96]))
    assert clipped.tolist() == [False, False, True, False]
    loss.sum().backward()
    # d/dv: w (v - R) on the unclipped branch; 0 where the clipped branch wins (clamp saturated)
    torch.testing.assert_close(v.grad, torch.tensor([-1.0, 1.0, 0.0, -2.4]))


def test_unclipped_value_loss_by_hand() -> None:
    v = torch.tensor(V, requires_grad=True)
    loss, clipped = value_loss(v, torch.tensor(R), torch.tensor(OLD), torch.tensor(W), None)
    torch.testing.assert_close(loss, torch.tensor([0.25, 0.5, 0.25, 0.96]))
    assert not clipped.any()
    loss.sum().backward()
    torch.testing.assert_close(v.grad, torch.tensor([-1.0, 1.0, -0.5, -2.4]))


@pytest.mark.parametrize("clip", [0.0, -0.1, float("nan"), float("inf")])
def test_bad_value_clip_rejected_by_the_run_config(clip: float) -> None:
    config = RLConfig(critic=CriticConfig(value_clip=clip))
    with pytest.raises(InputError, match="critic.value_clip"):
        config.validate()


@pytest.mark.parametrize("clip", [-0.1, float("nan"), True, "0.2"])
def test_bad_value_clip_rejected_by_the_objective(clip: object) -> None:
    e = make()
    datums, returns, old, weights = batch(LENGTHS)
    with pytest.raises(InputError, match="value_clip"):
        e.forward(with_inputs(datums, returns, old, weights), "value", {"value_clip": clip})


# ------------------------------------------------------------------- the engine


def independent_loss(e: TrainingEngine, datums, returns, old, weights, clip) -> torch.Tensor:
    """Per datum, unpadded, the formula written out with an explicit branch choice."""
    total = torch.zeros(())
    for d, r, o, w in zip(datums, returns, old, weights, strict=True):
        v = e.model(d.model_input.unsqueeze(0))[0]
        plain = 0.5 * (v - r) ** 2
        if clip is None:
            total = total + (w * plain).sum()
            continue
        v_clip = torch.minimum(torch.maximum(v, o - clip), o + clip)
        other = 0.5 * (v_clip - r) ** 2
        total = total + (w * torch.where(other > plain, other, plain)).sum()
    return total


@pytest.mark.parametrize("clip", [0.2, None])
def test_values_loss_and_grads_match_independent(clip: float | None) -> None:
    e = make(max_tokens_per_microbatch=12)
    datums, returns, old, weights = batch(LENGTHS)
    values_ = values(e, datums)
    for d, v in zip(datums, values_, strict=True):
        assert v.dtype == torch.float32 and v.shape == (len(d),) and not v.requires_grad
        with torch.no_grad():
            torch.testing.assert_close(v, e.model(d.model_input.unsqueeze(0))[0], atol=1e-6, rtol=0)
    old = [v + o for v, o in zip(values_, old, strict=True)]  # near the values: both branches
    data = with_inputs(datums, returns, old, weights)
    out = e.forward_backward(data, "value", {"value_clip": clip or 0.0})
    got = grads(e)
    e.zero_grad()
    expected = independent_loss(e, datums, returns, old, weights, clip)
    expected.backward()
    assert out.metrics["loss:sum"] == pytest.approx(float(expected.detach()), rel=1e-5)
    assert_close_dicts(grads(e), got, rel=1e-5)
    assert float(got["value_head.weight"].abs().sum()) > 0
    for v, o in zip(values_, out.outputs, strict=True):  # the pass reports the values it fit
        torch.testing.assert_close(o["values"], v, atol=1e-6, rtol=0)
    if clip is not None:  # both branches win somewhere: the test exercises the clip
        _, clipped = value_loss(*(torch.cat(x) for x in (values_, returns, old, weights)), clip)
        assert 0 < float(clipped[torch.cat(weights) != 0].float().mean()) < 1


def test_microbatch_budget_does_not_change_results() -> None:
    datums, returns, old, weights = batch([7, 2, 5, 9], seed=1)
    results = []
    for budget in (1, 0):  # every datum alone vs one padded pass
        e = make(max_tokens_per_microbatch=budget)
        found = values(e, datums)
        metrics = train(e, datums, returns, old, weights)
        results.append((found, grads(e), metrics["loss:sum"]))
    (va, ga, la), (vb, gb, lb) = results
    for a, b in zip(va, vb, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert_close_dicts(ga, gb, rel=1e-6)
    assert la == pytest.approx(lb, rel=1e-6)


def test_gradient_checkpointing_checkpoints_the_trunk() -> None:
    """``gradient_checkpointing`` on a critic checkpoints its trunk (the HF model; the
    ValueModel itself has no such switch) and changes no loss or gradient."""
    datums, returns, old, weights = batch(LENGTHS, seed=3)
    model = critic_from_pretrained("tiny-qwen3")
    checkpointed = TrainingEngine(model, None, EngineConfig(gradient_checkpointing=True))
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.trunk.modules())
    plain = make()
    la = train(plain, datums, returns, old, weights)["loss:sum"]
    lb = train(checkpointed, datums, returns, old, weights)["loss:sum"]
    assert la == pytest.approx(lb, rel=1e-6)
    assert_close_dicts(grads(plain), grads(checkpointed), rel=1e-6)


def test_gradients_accumulate_across_calls() -> None:
    datums, returns, old, weights = batch(LENGTHS, seed=2)
    whole = make()
    train(whole, datums, returns, old, weights)
    parts = make()
    train(parts, datums[:1], returns[:1], old[:1], weights[:1])
    train(parts, datums[1:], returns[1:], old[1:], weights[1:])
    assert_close_dicts(grads(whole), grads(parts), rel=1e-6)


def test_training_fits_a_toy_target() -> None:
    e = make()
    datums, _, _, _ = batch(LENGTHS, seed=3)
    targets = [torch.linspace(-1.0, 1.0, len(d)) for d in datums]  # position-dependent
    weights = [torch.full((len(d),), 1.0 / sum(LENGTHS)) for d in datums]
    losses = []
    for _ in range(12):
        old = values(e, datums)  # the usual PPO pattern: clip around this step's values
        losses.append(train(e, datums, targets, old, weights)["loss:sum"])
        e.optim_step(ADAM)
    assert e.step == 12
    assert losses[-1] < 0.5 * losses[0]


def test_save_load_is_bit_identical(tmp_path: Path) -> None:
    datums, returns, old, weights = batch(LENGTHS, seed=4)
    a = make(seed=0)
    for _ in range(2):
        train(a, datums, returns, old, weights)
        a.optim_step(ADAM)
    path = a.save_state(tmp_path / "critic", info=INFO)
    b = make(seed=7)  # another head init; the load overwrites it
    assert not torch.equal(params(a)["value_head.weight"], params(b)["value_head.weight"])
    b.load_state(path, expect_info=INFO)
    assert b.step == 2
    assert all(torch.equal(x, y) for x, y in zip(values(a, datums), values(b, datums), strict=True))
    for e in (a, b):
        train(e, datums, returns, old, weights)
        e.optim_step(ADAM)
    pa, pb = params(a), params(b)
    assert "value_head.weight" in pa and "value_head.bias" in pa
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


def test_load_refuses_a_foreign_checkpoint(tmp_path: Path) -> None:
    from tests.train.helpers import engine

    engine().save_state(tmp_path / "actor")
    e = make()
    before = params(e)
    with pytest.raises(InputError, match="role"):
        e.load_state(tmp_path / "actor", expect_info=INFO)
    assert all(torch.equal(before[n], p) for n, p in params(e).items())


def _bad_cases():
    def drop_last(xs, i):
        xs[i] = xs[i][:-1]

    def nan(xs, i):
        xs[i] = xs[i].clone()
        xs[i][1] = float("nan")

    def policy_target(b):  # the critic has no LM head: a policy objective is not its own
        b.append("ppo")

    return [
        (
            "returns",
            lambda b: drop_last(b[1], 2),
            r"datum 2: loss_fn_inputs\['returns'\] has shape \(7,\), expected \(8,\)",
        ),
        (
            "old_values",
            lambda b: nan(b[2], 1),
            r"datum 1: loss_fn_inputs\['old_values'\] holds NaN",
        ),
        (
            "weights",
            lambda b: b[3].__setitem__(0, torch.ones(6, 1)),
            r"datum 0: loss_fn_inputs\['weights'\] has shape \(6, 1\)",
        ),
        (
            "returns",
            lambda b: b[1].__setitem__(2, torch.tensor([1e39] * 8)),
            r"datum 2: loss_fn_inputs\['returns'\] holds",
        ),
        (
            "datum",
            lambda b: b[0].__setitem__(2, Datum([3, 900, 4, 5, 6, 7, 8, 9])),
            r"datum 2: .*900",
        ),
        (
            "loss_fn",
            policy_target,
            r"loss_fn: unknown objective 'ppo'; expected one of \['value'\]",
        ),
    ]


@pytest.mark.parametrize(("field", "corrupt", "message"), _bad_cases())
def test_bad_inputs_rejected_before_any_change(field: str, corrupt, message: str) -> None:
    e = make()
    good = batch(LENGTHS, seed=5)
    train(e, *good)  # accumulated gradients that a bad call must not touch
    before_params, before_grads = params(e), grads(e)
    calls = []
    hook = e.model.register_forward_pre_hook(lambda *_: calls.append(1))
    hook_trunk = e.model.trunk.register_forward_pre_hook(lambda *_: calls.append(1))
    bad = [list(x) for x in batch(LENGTHS, seed=5)]
    corrupt(bad)
    loss_fn = bad.pop() if len(bad) == 5 else "value"
    with pytest.raises(InputError, match=message):
        e.forward_backward(with_inputs(*bad), loss_fn)
    hook.remove()
    hook_trunk.remove()
    assert calls == []  # validated whole before the first forward
    assert all(torch.equal(before_params[n], p) for n, p in params(e).items())
    assert all(torch.equal(before_grads[n], g) for n, g in grads(e).items())


def test_empty_request_rejected() -> None:
    with pytest.raises(InputError, match="datums: expected a non-empty list"):
        make().forward_backward([], "value")
