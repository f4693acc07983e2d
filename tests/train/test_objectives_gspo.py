"""``gspo`` (GSPO-token, Zheng et al. 2025): the sequence ratio over the tokens
``sequence_ratio_mask`` marks, clipped like PPO, with every token's own gradient.

Values and gradients w.r.t. the trainer log-probs ``lp`` are derived by hand in the comments
and checked against independent float64 computations: the token form with autograd, and the
paper's sequence-level GSPO (full gradient through the sequence ratio), which has the same
gradient when a datum's advantages are all equal.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from furlong.errors import InputError
from furlong.train.objectives import datum_losses, get_objective
from furlong.train.validation import check_request
from furlong.types import Datum
from tests.train.helpers import engine, random_datums

pytestmark = pytest.mark.usefixtures("one_thread")

GSPO = get_objective("gspo")
CFG = GSPO.resolve_config({"clip_low_threshold": 0.9, "clip_high_threshold": 1.05})

# Datum 0 (rows 0-2, all marked): lp - s = [0.3, -0.1, 0.1], mean 0.1, so q0 = e^0.1 = 1.1052,
# above hi = 1.05. Datum 1 (rows 3-6): row 3 unmarked with lp - s = -3 (kept out of the mean),
# marked lp - s = [-0.4, -0.2, 0.0], mean -0.2, so q1 = e^-0.2 = 0.8187, below lo = 0.9.
LP = [-1.0, -2.0, -0.5, -3.0, -0.7, -1.2, -2.5]
DIFF = [0.3, -0.1, 0.1, -3.0, -0.4, -0.2, 0.0]
MASK = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
ADV = [2.0, -1.0, 0.5, 3.0, 1.5, -2.0, 0.25]
SEGMENT = [0, 0, 0, 1, 1, 1, 1]
Q0, Q1 = math.exp(0.1), math.exp(-0.2)
# Per row -min(q A, clip(q) A); the gradient -q A where q A is the min, else 0:
#   q0 > hi:  A = 2   -> 1.05*2 clipped: loss -2.1, grad 0
#             A = -1  -> q0*(-1) unclipped: loss q0, grad q0
#             A = 0.5 -> 1.05*0.5 clipped: loss -0.525, grad 0
#   q1 < lo:  A = 3 (unmarked, still summed) -> q1*3 unclipped: loss -3 q1, grad -3 q1
#             A = 1.5 -> q1*1.5 unclipped: loss -1.5 q1, grad -1.5 q1
#             A = -2  -> 0.9*(-2) clipped: loss 1.8, grad 0
#             A = .25 -> q1*.25 unclipped: loss -.25 q1, grad -.25 q1
TOKEN_LOSS = [-2.1, Q0, -0.525, -3 * Q1, -1.5 * Q1, 1.8, -0.25 * Q1]
TOKEN_GRAD = [0.0, Q0, 0.0, -3 * Q1, -1.5 * Q1, 0.0, -0.25 * Q1]


def _inputs(diff=DIFF, mask=MASK, adv=ADV) -> dict[str, torch.Tensor]:
    s = [lp - d for lp, d in zip(LP, diff, strict=True)]
    return {
        "logprobs": torch.tensor(s),
        "advantages": torch.tensor(adv),
        "sequence_ratio_mask": torch.tensor(mask),
    }


def _run(inputs, cfg=CFG, recompute=False, segment=SEGMENT, num=2, datum_mask=None):
    lp = torch.tensor(LP, requires_grad=True)
    m = torch.ones(len(LP)) if datum_mask is None else datum_mask

    def fn(lp_: torch.Tensor) -> torch.Tensor:
        return datum_losses(GSPO, cfg, lp_, inputs, m, torch.tensor(segment), num)

    out = checkpoint(fn, lp, use_reentrant=False) if recompute else fn(lp)
    out.sum().backward()
    return out.detach(), lp.grad


def _float64_token_form(lp, s, adv, mask, segment, lo, hi) -> torch.Tensor:
    """GSPO-token written out per datum in float64: s_t = sg(q) * exp(lp_t - sg(lp_t))."""
    total = lp.new_zeros(())
    for d in sorted(set(segment.tolist())):
        rows = segment == d
        marked = rows & (mask != 0)
        q = torch.exp((lp[marked] - s[marked]).mean()).detach()
        ratio = q * torch.exp(lp[rows] - lp[rows].detach())
        a = adv[rows]
        total = total - torch.minimum(ratio * a, ratio.clamp(lo, hi) * a).sum()
    return total


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_hand_values_and_gradient_clip_both_ways(recompute):
    per_datum, grad = _run(_inputs(), recompute=recompute)
    want = torch.tensor([sum(TOKEN_LOSS[:3]), sum(TOKEN_LOSS[3:])])
    torch.testing.assert_close(per_datum, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, torch.tensor(TOKEN_GRAD), rtol=0, atol=1e-5)


def test_matches_an_independent_float64_computation():
    g = torch.Generator().manual_seed(3)
    n, segment = 12, torch.tensor([0] * 5 + [1] * 4 + [2] * 3)
    lp = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    s = lp - torch.randn(n, generator=g, dtype=torch.float64) * 0.2
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.tensor([0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1], dtype=torch.float64)
    lo, hi = 0.95, 1.02
    lp64 = lp.clone().requires_grad_(True)
    want = _float64_token_form(lp64, s, adv, mask, segment, lo, hi)
    (want_grad,) = torch.autograd.grad(want, lp64)

    lp32 = lp.float().requires_grad_(True)
    inputs = {"logprobs": s.float(), "advantages": adv.float(), "sequence_ratio_mask": mask.float()}
    cfg = GSPO.resolve_config({"clip_low_threshold": lo, "clip_high_threshold": hi})
    got = datum_losses(GSPO, cfg, lp32, inputs, torch.ones(n), segment, 3)
    got.sum().backward()
    torch.testing.assert_close(got.sum().double(), want.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(lp32.grad.double(), want_grad, rtol=0, atol=1e-5)


def test_equals_sequence_level_gspo_when_advantages_are_per_datum():
    """Paper eqs. (11)/(18): with one advantage per datum and every token marked, the token
    form's gradient is sequence-level GSPO's, whose ratio q = exp(mean(lp - s)) keeps its
    gradient: d/dlp_t of -n min(q A, clip(q) A) is -q A (unclipped) or 0."""
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    s = lp.detach() - torch.tensor(DIFF, dtype=torch.float64)
    segment = torch.tensor(SEGMENT)
    adv_per_datum = [-1.5, 0.75]  # q0 = e^0.1 > hi, q1 = e^-0.9 < lo: both unclipped mins
    total = lp.new_zeros(())
    for d, a in enumerate(adv_per_datum):
        rows = segment == d
        q = torch.exp((lp[rows] - s[rows]).mean())
        total = total - rows.sum() * torch.minimum(q * a, q.clamp(0.9, 1.05) * a)
    (want_grad,) = torch.autograd.grad(total, lp)

    adv = [adv_per_datum[d] for d in SEGMENT]
    per_datum, grad = _run(_inputs(mask=[1.0] * 7, adv=adv))
    torch.testing.assert_close(per_datum.sum().double(), total.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(grad.double(), want_grad, rtol=0, atol=1e-5)
    assert want_grad.abs().sum() > 0


def test_unmarked_tokens_stay_out_of_the_ratio_and_the_datum_mask_zeroes_everything():
    base, grad = _run(_inputs())
    # row 3 is unmarked: whatever its sampler log-prob, q1 and every value stay the same
    moved = list(DIFF)
    moved[3] = 2.5
    again, grad_again = _run(_inputs(diff=moved))
    assert torch.equal(base, again) and torch.equal(grad, grad_again)
    # marking it moves datum 1's ratio: mean(-3, -0.4, -0.2, 0) = -0.9
    marked, _ = _run(_inputs(mask=[1.0] * 7))
    q1 = math.exp(-0.9)  # < lo: A = 3, 1.5, .25 unclipped, A = -2 clipped at 0.9
    want = -(3 + 1.5 + 0.25) * q1 + 1.8
    assert marked[1].item() == pytest.approx(want, abs=1e-5)
    assert torch.equal(marked[0], base[0])  # datum 0 is its own
    # the datum mask m (padding): no loss, no gradient
    off, grad_off = _run(_inputs(), datum_mask=torch.zeros(7))
    assert torch.equal(off, torch.zeros(2)) and torch.equal(grad_off, torch.zeros(7))


def test_default_thresholds_are_the_papers():
    cfg = GSPO.resolve_config(None)
    per_datum, _ = _run(_inputs(), cfg=cfg)
    # q0 = 1.105 > 1.0004 and q1 = 0.819 < 0.9997: as above with the paper's bounds
    hi, lo = 1 + 4e-4, 1 - 3e-4
    want = [-2 * hi + Q0 - 0.5 * hi, -(3 + 1.5 + 0.25) * Q1 + 2 * lo]
    torch.testing.assert_close(per_datum, torch.tensor(want), rtol=0, atol=1e-5)


def _gspo_datums(lengths: list[int]) -> list[Datum]:
    data = random_datums(lengths, "gspo", seed=5)
    out = []
    for d in data:
        mask = torch.ones(len(d))
        mask[:2] = 0  # prompt-like positions outside the ratio
        out.append(Datum(d.model_input, {**d.loss_fn_inputs, "sequence_ratio_mask": mask}))
    return out


def test_through_the_engine_and_microbatches():
    """The engine's loss:sum equals the float64 form on the log-probs it returns, and a
    datum's ratio never mixes with its microbatch neighbours'."""
    data = _gspo_datums([6, 9, 4])
    config = {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}
    whole = engine().forward_backward(data, "gspo", config)
    lp = torch.cat([o["logprobs"] for o in whole.outputs]).double()
    cat = {k: torch.cat([d.loss_fn_inputs[k] for d in data]).double() for k in GSPO.inputs}
    segment = torch.cat([torch.full((len(d),), i) for i, d in enumerate(data)])
    want = _float64_token_form(
        lp, cat["logprobs"], cat["advantages"], cat["sequence_ratio_mask"], segment, 0.5, 1.5
    )
    assert whole.metrics["loss:sum"] == pytest.approx(float(want), abs=1e-4)
    split = engine(max_tokens_per_microbatch=9).forward_backward(data, "gspo", config)
    for a, b in zip(whole.outputs, split.outputs, strict=True):
        torch.testing.assert_close(a["loss"], b["loss"], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("sequence_ratio_mask"), r"datum 1: .*'sequence_ratio_mask'.* missing"),
        (
            lambda d: d.__setitem__("sequence_ratio_mask", torch.zeros(9)),
            r"datum 1: loss_fn_inputs\['sequence_ratio_mask'\] marks no token",
        ),
        (
            lambda d: d.__setitem__("sequence_ratio_mask", torch.ones(8)),
            r"datum 1: loss_fn_inputs\['sequence_ratio_mask'\] has shape \(8,\)",
        ),
    ],
)
def test_the_ratio_mask_is_required_and_must_mark_a_token(edit, message):
    data = _gspo_datums([6, 9])
    inputs = dict(data[1].loss_fn_inputs)
    edit(inputs)
    with pytest.raises(InputError, match=message):
        check_request([data[0], Datum(data[1].model_input, inputs)], "gspo", None)
