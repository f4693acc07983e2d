"""Sampling-mask replay in the log-prob path: log-probs renormalised over each position's
kept set, against a brute-force renormalised softmax."""

from __future__ import annotations

import math

import pytest
import torch

from furlong.errors import InputError
from furlong.rollout.sampling_mask import SamplingMask
from furlong.train.logprobs import masked_token_logprobs, support_matrix, upcast
from tests.train.logprob_reference import shard_masked_stats

pytestmark = pytest.mark.usefixtures("one_thread")

V = 12
SUPPORTS = [[3, 7, 1], [5], [0, 2, 4, 6, 8, 10], [11, 9], [4], [1, 2, 3, 4, 5, 6, 7]]
TARGETS = torch.tensor([7, 5, 6, 11, 4, 2])


def brute_force(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Independent: softmax over the full vocab, then renormalised over each support."""
    out = []
    for row, support, a in zip(logits.double(), SUPPORTS, TARGETS.tolist(), strict=True):
        p = torch.softmax(row / temperature, -1)
        out.append(torch.log(p[a] / p[support].sum()))
    return torch.stack(out)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [0, 2, 4])
def test_masked_logprobs_equal_renormalised_softmax(temperature: float, chunk: int) -> None:
    logits = (torch.randn(len(SUPPORTS), V) * 3).requires_grad_()
    ids, offsets = SamplingMask.from_lists(SUPPORTS).tensors()
    lp = masked_token_logprobs(
        logits, TARGETS, ids, offsets, temperature=temperature, chunk_size=chunk
    )
    assert lp.dtype == torch.float32
    torch.testing.assert_close(
        lp.double(), brute_force(logits.detach(), temperature), atol=1e-6, rtol=0
    )

    coeff = torch.linspace(0.5, 2.0, len(SUPPORTS))
    (lp * coeff).sum().backward()
    ref_logits = logits.detach().double().requires_grad_()
    (brute_force(ref_logits, temperature) * coeff.double()).sum().backward()
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, atol=1e-6, rtol=0)

    keep = support_matrix(V, ids, offsets)
    assert not logits.grad[~keep].any()  # no gradient outside the kept set
    singles = [i for i, s in enumerate(SUPPORTS) if len(s) == 1]
    assert lp[singles].tolist() == [0.0] * len(singles)  # singleton: exactly 0, zero grad
    assert not logits.grad[singles].any()


def test_masked_replay_differs_from_full_vocab() -> None:
    """The point of replay: the full-vocab score is a different policy."""
    logits = torch.randn(len(SUPPORTS), V) * 3
    ids, offsets = SamplingMask.from_lists(SUPPORTS).tensors()
    masked = masked_token_logprobs(logits, TARGETS, ids, offsets)
    full = torch.log_softmax(logits, -1).gather(-1, TARGETS.unsqueeze(-1)).squeeze(-1)
    assert bool((masked > full).all())  # renormalising over a subset raises every log-prob


def test_target_outside_support_is_rejected() -> None:
    ids, offsets = SamplingMask.from_lists(SUPPORTS).tensors()
    bad = TARGETS.clone()
    bad[3] = 0
    with pytest.raises(InputError, match="position 3: target token 0"):
        masked_token_logprobs(torch.randn(len(SUPPORTS), V), bad, ids, offsets)
    with pytest.raises(InputError, match="5 positions for 6 rows"):
        masked_token_logprobs(torch.randn(6, V), TARGETS, ids[:-7], offsets[:-1])


def test_two_vocab_shards_combine_to_the_unsharded_result() -> None:
    logits = torch.randn(len(SUPPORTS), V) * 3
    ids, offsets = SamplingMask.from_lists(SUPPORTS).tensors()
    z = upcast(logits, 0.8)
    half = V // 2
    stats = [
        shard_masked_stats(z[:, :half], support_matrix(half, ids, offsets, vocab_start=0)),
        shard_masked_stats(z[:, half:], support_matrix(V - half, ids, offsets, vocab_start=half)),
    ]
    assert math.isinf(float(stats[1][1]))  # position 1 keeps only token 5: nothing in shard 2
    lse = torch.logsumexp(torch.stack(stats), dim=0)
    sharded = z.gather(-1, TARGETS.unsqueeze(-1)).squeeze(-1) - lse
    unsharded = masked_token_logprobs(logits, TARGETS, ids, offsets, temperature=0.8)
    torch.testing.assert_close(sharded, unsharded, atol=1e-6, rtol=0)
