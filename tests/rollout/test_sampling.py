"""The sampling step: kept sets for top-k / top-p / min-p against brute force, log-probs under
the renormalised distribution, seeded reproducibility, and the empirical distribution."""

from __future__ import annotations

import math

import pytest
import torch

from furlong.errors import InputError
from furlong.rollout.sampling import (
    SamplingParams,
    draw,
    draw_batch,
    kept_distribution,
    request_generator,
)

LOGITS = torch.tensor([2.0, 0.5, -1.0, 1.5, 0.0, 3.0, -2.0, 1.0])


def kept_ids(params: SamplingParams, logits=LOGITS) -> list[int]:
    return torch.isfinite(kept_distribution(logits, params)).nonzero().squeeze(-1).tolist()


def test_top_k_keeps_the_k_largest_and_renormalises() -> None:
    params = SamplingParams(top_k=3, temperature=0.5)
    assert kept_ids(params) == [0, 3, 5]
    logp = kept_distribution(LOGITS, params)
    p = torch.softmax(LOGITS / 0.5, -1)
    expected = torch.log(p[[0, 3, 5]] / p[[0, 3, 5]].sum())
    torch.testing.assert_close(logp[[0, 3, 5]], expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9, 0.99])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p: float) -> None:
    p = torch.softmax(LOGITS, -1)
    order = torch.argsort(p, descending=True).tolist()
    mass, brute = 0.0, []
    for i in order:  # independent: add tokens until the kept mass reaches top_p
        brute.append(i)
        mass += float(p[i])
        if mass >= top_p:
            break
    assert kept_ids(SamplingParams(top_p=top_p)) == sorted(brute)


def test_min_p_keeps_tokens_above_a_fraction_of_the_max() -> None:
    p = torch.softmax(LOGITS, -1)
    brute = (p >= 0.2 * p.max()).nonzero().squeeze(-1).tolist()
    assert kept_ids(SamplingParams(min_p=0.2)) == brute


def test_greedy_is_argmax_with_logprob_zero() -> None:
    d = draw(LOGITS, SamplingParams(temperature=0, return_sampling_mask=True), request_generator(1))
    assert d.token == 5 and d.logprob == 0.0 and d.kept.tolist() == [5]


def test_seeded_draws_repeat_and_stay_in_the_kept_set() -> None:
    params = SamplingParams(top_k=4, top_p=0.9, return_sampling_mask=True)

    def run(seed: int) -> list[int]:
        g = request_generator(seed)
        out = []
        for _ in range(50):
            d = draw(LOGITS, params, g)
            assert d.token in d.kept.tolist()
            logp = kept_distribution(LOGITS, params)
            assert d.logprob == pytest.approx(float(logp[d.token]), abs=1e-7)
            out.append(d.token)
        return out

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_a_rows_draw_does_not_depend_on_its_batch() -> None:
    """Whole-vocabulary rows drawn alone (the batch skips masking) equal the same rows drawn
    beside a top-k row and a greedy row (the batch masks): same tokens, and log-probs equal to
    log_softmax(logits / temperature) at the token."""
    plain = [SamplingParams(temperature=t, seed=s) for t, s in ((1.0, 3), (0.6, 4))]
    others = [SamplingParams(top_k=2, seed=5), SamplingParams(temperature=0.0, seed=6)]
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS * 0.5, LOGITS + 1])
    for _ in range(20):
        seeds = [p.seed for p in plain + others]
        gens = [request_generator(s) for s in seeds]
        alone = draw_batch(logits[:2], plain, gens[:2])
        gens = [request_generator(s) for s in seeds]
        mixed = draw_batch(logits, plain + others, gens)
        for row, (a, m, p) in enumerate(zip(alone, mixed, plain, strict=False)):
            assert a.token == m.token
            want = torch.log_softmax(logits[row] / p.temperature, -1)[a.token]
            assert a.logprob == pytest.approx(float(want), abs=1e-6)
            assert m.logprob == pytest.approx(float(want), abs=1e-6)
        assert mixed[2].token in logits[2].topk(2).indices.tolist()
        assert mixed[3].token == int(logits[3].argmax())
        logits = logits.roll(1, -1)  # other tokens on the next round


def test_empirical_frequencies_match_the_kept_distribution() -> None:
    params = SamplingParams(temperature=0.8, top_k=5)
    probs = kept_distribution(LOGITS, params).exp()
    g = request_generator(0)
    n = 6000
    counts = torch.zeros_like(probs)
    for _ in range(n):
        counts[draw(LOGITS, params, g).token] += 1
    assert counts[probs == 0].sum() == 0
    # 4 standard errors of a binomial proportion, per token
    for i in (probs > 0).nonzero().squeeze(-1).tolist():
        se = math.sqrt(float(probs[i] * (1 - probs[i])) / n)
        assert abs(float(counts[i]) / n - float(probs[i])) < 4 * se + 1e-9, i


def test_truncation_flag_drives_replay() -> None:
    assert not SamplingParams().truncates
    assert not SamplingParams(temperature=0, top_k=5).truncates
    assert SamplingParams(top_k=5).truncates and SamplingParams(top_p=0.9).truncates


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("temperature", -1.0),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 1.0),
        ("top_k", 2.5),
        ("stop", ("",)),
    ],
)
def test_bad_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(InputError, match=f"sampling_params.{field}"):
        SamplingParams(**{field: value})
