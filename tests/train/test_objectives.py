"""The Tinker objectives (contract (a)): per-token losses, gradients, masks, configs (gspo's
sequence ratio by hand in test_objectives_gspo.py).

Every expected value is derived by hand in the comments; gradients are taken w.r.t. the
trainer log-probs ``lp`` and compared against hand-derived or independently computed values.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from furlong.errors import InputError
from furlong.train.objectives import OBJECTIVES, datum_losses, get_objective

pytestmark = pytest.mark.usefixtures("one_thread")


NAMES = ["cispo", "cross_entropy", "dro", "gspo", "importance_sampling", "ppo"]

# ---------------------------------------------------------------------------------------------
# The matrix (miles' tests): 8 tokens, lp = -1 everywhere, s = -1 - ln r so exp(lp - s) = r.
# Datum 0 = tokens 0..2, datum 1 = tokens 3..7; the last two tokens are masked out.
# ---------------------------------------------------------------------------------------------
RATIOS = [0.5, 0.5, 1.0, 1.0, 5.0, 5.0, 0.5, 5.0]
ADV = [2.0, -3.0, 2.0, -3.0, 2.0, -3.0, 11.0, -13.0]
MASK = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
SEGMENT = [0, 0, 0, 1, 1, 1, 1, 1]
LN_R = [math.log(r) for r in RATIOS[:6]]
A6 = ADV[:6]


def _dro(beta: float) -> tuple[list[float], list[float]]:
    # L = -(lp A - beta/2 (lp - s)^2) with lp = -1 and lp - s = ln r:  A + beta/2 (ln r)^2
    # dL/dlp = -A + beta (lp - s) = -A + beta ln r
    loss = [a + beta / 2 * lr**2 for a, lr in zip(A6, LN_R, strict=True)]
    grad = [-a + beta * lr for a, lr in zip(A6, LN_R, strict=True)]
    return loss, grad


IS_LOSS = [-1.0, 1.5, -2.0, 3.0, -10.0, 15.0]  # -r A
CISPO_DEFAULT = [1.0, -1.5, 2.0, -3.0, 8.0, -12.0]  # clip(r, 0, 4) A  (lp = -1)
CISPO_NARROW = [1.5, -2.25, 2.0, -3.0, 4.0, -6.0]  # clip(r, .75, 2) A

# (name, config, expected loss on the 6 unmasked tokens, expected d loss / d lp)
MATRIX = [
    ("importance_sampling", None, IS_LOSS, IS_LOSS),  # d(-r A)/dlp = -r A
    # PPO (0.8, 1.2): clip = [.8,.8,1,1,1.2,1.2]; min(rA, cA) per token:
    #   (1, 1.6) -> 1 via r      (-1.5, -2.4) -> -2.4 clipped   (2, 2) tie, both slopes rA
    #   (-3, -3) tie             (10, 2.4) -> 2.4 clipped       (-15, -3.6) -> -15 via r
    (
        "ppo",
        None,
        [-1.0, 2.4, -2.0, 3.0, -2.4, 15.0],
        [-1.0, 0.0, -2.0, 3.0, 0.0, 15.0],
    ),
    ("ppo", {"clip_low_threshold": 0.4, "clip_high_threshold": 6.0}, IS_LOSS, IS_LOSS),
    # CISPO: -sg(c) lp A = c A, gradient -c A.
    ("cispo", None, CISPO_DEFAULT, [-v for v in CISPO_DEFAULT]),
    (
        "cispo",
        {"clip_low_threshold": 0.75, "clip_high_threshold": 2.0},
        CISPO_NARROW,
        [-v for v in CISPO_NARROW],
    ),
    ("dro", None, *_dro(0.05)),  # default beta is 0.05
    ("dro", {"beta": 0.5}, *_dro(0.5)),
]
MATRIX_IDS = ["is", "ppo", "ppo-0.4-6", "cispo", "cispo-0.75-2", "dro-0.05", "dro-0.5"]


def _matrix_inputs() -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    lp = torch.full((8,), -1.0, requires_grad=True)
    s = torch.tensor([-1.0 - math.log(r) for r in RATIOS])
    inputs = {"logprobs": s, "advantages": torch.tensor(ADV)}
    return lp, inputs, torch.tensor(MASK)


def _losses_and_grad(
    name: str,
    config: dict | None,
    segment: torch.Tensor,
    num_datums: int,
    recompute: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    objective = get_objective(name)
    cfg = objective.resolve_config(config)
    lp, inputs, mask = _matrix_inputs()

    def fn(lp_: torch.Tensor) -> torch.Tensor:
        return datum_losses(objective, cfg, lp_, inputs, mask, segment, num_datums)

    out = checkpoint(fn, lp, use_reentrant=False) if recompute else fn(lp)
    out.sum().backward()
    return out.detach(), lp.grad


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize(("name", "config", "loss", "grad"), MATRIX, ids=MATRIX_IDS)
def test_matrix(name, config, loss, grad, recompute):
    # Per token: every token is its own datum.
    per_token, g = _losses_and_grad(name, config, torch.arange(8), 8, recompute)
    assert per_token.dtype == torch.float32
    torch.testing.assert_close(per_token[:6], torch.tensor(loss), rtol=0, atol=1e-5)
    torch.testing.assert_close(per_token[6:], torch.zeros(2), rtol=0, atol=0)
    torch.testing.assert_close(g[:6], torch.tensor(grad), rtol=0, atol=1e-5)
    assert torch.equal(g[6:], torch.zeros(2)), "masked tokens must get no gradient"

    # Two datums (3 and 5 tokens): the per-datum losses are the segment sums of the token
    # losses and add up to the total; the gradient w.r.t. lp is unchanged.
    per_datum, g2 = _losses_and_grad(name, config, torch.tensor(SEGMENT), 2, recompute)
    expected = torch.tensor([sum(loss[:3]), sum(loss[3:])])
    torch.testing.assert_close(per_datum, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(per_datum.sum(), torch.tensor(float(sum(loss))), rtol=0, atol=1e-5)
    segment_sums = torch.stack([per_token[:3].sum(), per_token[3:].sum()])
    torch.testing.assert_close(per_datum, segment_sums, rtol=0, atol=1e-6)
    torch.testing.assert_close(g2, g, rtol=0, atol=0)


@pytest.mark.parametrize(("name", "config", "loss", "grad"), MATRIX, ids=MATRIX_IDS)
def test_matrix_recompute_is_identical(name, config, loss, grad):
    for segment, n in ((torch.arange(8), 8), (torch.tensor(SEGMENT), 2)):
        plain, g_plain = _losses_and_grad(name, config, segment, n, recompute=False)
        again, g_again = _losses_and_grad(name, config, segment, n, recompute=True)
        assert torch.equal(plain, again)
        assert torch.equal(g_plain, g_again)


# ---------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_zero_mask_gives_zero_loss_and_gradient(name):
    objective = get_objective(name)
    cfg = objective.resolve_config(None)
    lp = torch.tensor([-0.3, -1.7, -2.2, -0.9], requires_grad=True)
    s = torch.tensor([-1.1, -0.4, -2.9, -0.2])  # s != lp, so DRO's (lp - s)^2 term is nonzero
    inputs = {
        "logprobs": s,
        "advantages": torch.tensor([1.5, -2.0, 0.7, 3.0]),
        "weights": torch.tensor([1.0, 2.0, -0.5, 4.0]),
        "sequence_ratio_mask": torch.tensor([1.0, 0.0, 1.0, 1.0]),
    }
    # Sanity: with the mask on, the loss and gradient are not zero.
    on = datum_losses(objective, cfg, lp, inputs, torch.ones(4), torch.tensor([0, 0, 1, 1]), 2)
    (g_on,) = torch.autograd.grad(on.sum(), lp)
    assert on.abs().sum() > 0 and g_on.abs().sum() > 0

    off = datum_losses(objective, cfg, lp, inputs, torch.zeros(4), torch.tensor([0, 0, 1, 1]), 2)
    assert torch.equal(off, torch.zeros(2))
    off.sum().backward()
    assert torch.equal(lp.grad, torch.zeros(4))


# ---------------------------------------------------------------------------------------------
# cross_entropy
# ---------------------------------------------------------------------------------------------
def _ce(lp_values, w_values, segment, num_datums):
    objective = get_objective("cross_entropy")
    lp = torch.tensor(lp_values, requires_grad=True)
    w = torch.tensor(w_values)
    mask = torch.ones(lp.shape[0])
    out = datum_losses(
        objective,
        objective.resolve_config(None),
        lp,
        {"weights": w},
        mask,
        torch.tensor(segment),
        num_datums,
    )
    out.sum().backward()
    return out.detach(), lp.grad, w


def test_cross_entropy_hand_values():
    # -(2 * -0.5 + 3 * -0.25) = 1 + 0.75 = 1.75; d/dlp = -w
    out, grad, w = _ce([-0.5, -0.25], [2.0, 3.0], [0, 0], 1)
    torch.testing.assert_close(out, torch.tensor([1.75]), rtol=0, atol=0)
    torch.testing.assert_close(grad, torch.tensor([-2.0, -3.0]), rtol=0, atol=0)
    # One datum per token: [1.0, 0.75].
    out, _, _ = _ce([-0.5, -0.25], [2.0, 3.0], [0, 1], 2)
    torch.testing.assert_close(out, torch.tensor([1.0, 0.75]), rtol=0, atol=0)


def test_cross_entropy_negative_weights():
    # w = [-1, 2]: per token -w lp = [-(-1)(-0.5), -(2)(-0.25)] = [-0.5, 0.5], total 0.
    out, grad, _ = _ce([-0.5, -0.25], [-1.0, 2.0], [0, 1], 2)
    torch.testing.assert_close(out, torch.tensor([-0.5, 0.5]), rtol=0, atol=0)
    torch.testing.assert_close(grad, torch.tensor([1.0, -2.0]), rtol=0, atol=0)
    # w = [-1, 3]: -(0.5 - 0.75) = 0.25 in one datum.
    out, grad, _ = _ce([-0.5, -0.25], [-1.0, 3.0], [0, 0], 1)
    torch.testing.assert_close(out, torch.tensor([0.25]), rtol=0, atol=0)
    torch.testing.assert_close(grad, torch.tensor([1.0, -3.0]), rtol=0, atol=0)


def test_cross_entropy_two_dimensional_targets():
    objective = get_objective("cross_entropy")
    assert objective.top_k_targets
    lp = torch.tensor([[-0.5, -2.0], [-1.25, -0.75], [-3.0, -0.125]], requires_grad=True)
    w = torch.tensor([[2.0, 0.5], [-1.0, 4.0], [0.25, 8.0]])
    # Row losses -sum_k w lp:
    #   row 0: -(2 * -0.5 + 0.5 * -2)      = 1 + 1      = 2
    #   row 1: -(-1 * -1.25 + 4 * -0.75)   = -1.25 + 3  = 1.75
    #   row 2: -(0.25 * -3 + 8 * -0.125)   = 0.75 + 1   = 1.75
    mask = torch.tensor([1.0, 1.0, 1.0])
    out = datum_losses(objective, {}, lp, {"weights": w}, mask, torch.tensor([0, 1, 1]), 2)
    torch.testing.assert_close(out, torch.tensor([2.0, 3.5]), rtol=0, atol=0)
    out.sum().backward()
    torch.testing.assert_close(lp.grad, -w, rtol=0, atol=0)

    # A masked row drops out of the loss and gets no gradient.
    lp.grad = None
    out = datum_losses(
        objective, {}, lp, {"weights": w}, torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 1, 1]), 2
    )
    torch.testing.assert_close(out, torch.tensor([2.0, 1.75]), rtol=0, atol=0)
    out.sum().backward()
    torch.testing.assert_close(lp.grad, -w * torch.tensor([[1.0], [0.0], [1.0]]), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
def test_registry_names():
    assert sorted(OBJECTIVES) == NAMES
    for name in NAMES:
        assert get_objective(name).name == name


def test_config_defaults_and_none():
    assert get_objective("ppo").resolve_config(None) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.2,
    }
    assert get_objective("cispo").resolve_config(None) == {
        "clip_low_threshold": 0.0,
        "clip_high_threshold": 4.0,
    }
    assert get_objective("dro").resolve_config(None) == {"beta": 0.05}
    assert get_objective("gspo").resolve_config(None) == {  # the paper's ranges 3e-4 / 4e-4
        "clip_low_threshold": 1 - 3e-4,
        "clip_high_threshold": 1 + 4e-4,
    }
    assert get_objective("cross_entropy").resolve_config(None) == {}
    assert get_objective("importance_sampling").resolve_config(None) == {}
    assert get_objective("ppo").resolve_config({}) == get_objective("ppo").resolve_config(None)


def test_config_overrides_applied():
    ppo = get_objective("ppo")
    assert ppo.resolve_config({"clip_high_threshold": 2}) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 2.0,
    }
    cfg = ppo.resolve_config({"clip_low_threshold": 0.5})
    assert cfg == {"clip_low_threshold": 0.5, "clip_high_threshold": 1.2}
    assert isinstance(get_objective("dro").resolve_config({"beta": 1})["beta"], float)
    assert get_objective("dro").resolve_config({"beta": 0}) == {"beta": 0.0}
    # The defaults are not mutated by an override.
    assert ppo.resolve_config(None)["clip_low_threshold"] == 0.8


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        (
            "ppo",
            {"clip_lo": 0.5},  # a typo must not train with the defaults
            "loss_fn_config: unknown key 'clip_lo' for 'ppo'; expected a subset of "
            "['clip_high_threshold', 'clip_low_threshold']",
        ),
        (
            "ppo",
            {"clip_high_threshold": 2, "beta": 0.1},  # another objective's key
            "loss_fn_config: unknown key 'beta' for 'ppo'",
        ),
        ("dro", {"beta": 0.1, "mode": "x"}, "loss_fn_config: unknown key 'mode' for 'dro'"),
        (
            "cross_entropy",
            {"x": 1},
            "loss_fn_config: unknown key 'x' for 'cross_entropy'; it takes no loss_fn_config",
        ),
        (
            "importance_sampling",
            {"clip_low_threshold": 0.8},
            "loss_fn_config: unknown key 'clip_low_threshold' for 'importance_sampling'",
        ),
    ],
)
def test_config_unknown_keys_are_refused_naming_the_key(name, config, message):
    with pytest.raises(InputError) as info:
        get_objective(name).resolve_config(config)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("name", ["stable_reinforce", "custom"])
def test_tinker_losses_furlong_lacks_are_refused_by_name(name):
    with pytest.raises(InputError) as info:
        get_objective(name)
    message = str(info.value)
    assert message.startswith(f"loss_fn: {name!r} is not supported by furlong")
    assert all(known in message for known in NAMES)


@pytest.mark.parametrize(
    ("name", "key", "value"),
    [
        ("ppo", "clip_low_threshold", "0.5"),
        ("ppo", "clip_high_threshold", None),
        ("ppo", "clip_high_threshold", True),
        ("ppo", "clip_low_threshold", [0.5]),
        ("ppo", "clip_low_threshold", float("nan")),
        ("cispo", "clip_high_threshold", float("inf")),
        ("cispo", "clip_low_threshold", float("-inf")),
        ("dro", "beta", float("nan")),
        ("dro", "beta", "0.1"),
    ],
)
def test_config_bad_values_raise_naming_the_key(name, key, value):
    with pytest.raises(InputError, match=key):
        get_objective(name).resolve_config({key: value})


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("ppo", {"clip_low_threshold": 1.3}),  # > default high 1.2
        ("ppo", {"clip_low_threshold": 2.0, "clip_high_threshold": 1.0}),
        ("cispo", {"clip_high_threshold": -1.0}),  # < default low 0
        ("cispo", {"clip_low_threshold": -0.1}),  # thresholds are ratios: must be >= 0
    ],
)
def test_config_inverted_thresholds_raise(name, config):
    with pytest.raises(InputError, match="clip_low_threshold"):
        get_objective(name).resolve_config(config)


def test_config_equal_thresholds_allowed():
    cfg = get_objective("ppo").resolve_config({"clip_low_threshold": 1, "clip_high_threshold": 1})
    assert cfg == {"clip_low_threshold": 1.0, "clip_high_threshold": 1.0}


def test_config_negative_beta_raises():
    with pytest.raises(InputError, match="beta"):
        get_objective("dro").resolve_config({"beta": -0.01})


@pytest.mark.parametrize("name", ["sft", "PPO", "", None, 3])
def test_unknown_objective_raises_listing_names(name):
    with pytest.raises(InputError) as info:
        get_objective(name)
    for known in NAMES:
        assert known in str(info.value)


# ---------------------------------------------------------------------------------------------
# CISPO stop-gradient, against an independent formula on nonuniform inputs
# ---------------------------------------------------------------------------------------------
def test_cispo_gradient_does_not_flow_through_the_ratio():
    lo, hi = 0.6, 1.5
    objective = get_objective("cispo")
    cfg = objective.resolve_config({"clip_low_threshold": lo, "clip_high_threshold": hi})
    lp_values = [-0.2, -1.3, -0.7, -2.5, -0.05, -1.9]
    s_values = [-0.9, -1.0, -0.7, -1.2, -0.5, -2.6]
    a_values = [1.5, -0.5, 2.0, -3.0, 0.25, 4.0]
    lp = torch.tensor(lp_values, requires_grad=True)
    inputs = {"logprobs": torch.tensor(s_values), "advantages": torch.tensor(a_values)}
    out = datum_losses(objective, cfg, lp, inputs, torch.ones(6), torch.arange(6), 6)
    out.sum().backward()

    # Independent (pure Python) formula with r treated as a constant.
    exp_loss, exp_grad, full_grad = [], [], []
    for lpv, sv, av in zip(lp_values, s_values, a_values, strict=True):
        r = math.exp(lpv - sv)
        c = min(max(r, lo), hi)
        exp_loss.append(-c * lpv * av)
        exp_grad.append(-c * av)
        # What the gradient would be WITHOUT the stop-gradient (d c / d lp = r inside the clip).
        full_grad.append(-c * av - (r if lo < r < hi else 0.0) * lpv * av)
    torch.testing.assert_close(out, torch.tensor(exp_loss), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lp.grad, torch.tensor(exp_grad), rtol=1e-6, atol=1e-6)
    # The inputs include unclipped ratios, where the two gradients really differ.
    assert any(abs(a - b) > 1e-3 for a, b in zip(exp_grad, full_grad, strict=True))
    assert not torch.allclose(lp.grad, torch.tensor(full_grad))
