"""Advantage estimators against hand computations (values worked out in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from furlong.rl import advantages as adv


def close(got, want, tol: float = 1e-5) -> None:
    torch.testing.assert_close(torch.as_tensor(got).float(), torch.tensor(want), atol=tol, rtol=0)


def test_group_relative_centres_and_scales_per_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    # group 1: mean .5, unbiased std sqrt(4 * .25 / 3) = .57735 -> +-.86603
    # group 2: mean .75, deviations (.25, .25, .25, -.75), var (3 * .0625 + .5625) / 3 = .25
    got = adv.group_relative(rewards, 4)
    close(got, [0.86603, -0.86603, -0.86603, 0.86603, 0.5, 0.5, 0.5, -1.5], 1e-4)
    close(
        adv.group_relative(rewards, 4, scale_by_std=False),
        [0.5, -0.5, -0.5, 0.5] + [0.25] * 3 + [-0.75],
    )
    close(adv.group_relative(torch.ones(4), 2), [0.0] * 4)  # a solved group teaches nothing
    with pytest.raises(ValueError, match="groups of 3"):
        adv.group_relative(rewards, 3)


def test_grpo_spreads_the_score_and_subtracts_the_kl_return() -> None:
    rewards = torch.tensor([1.0, 0.0])
    kl = [torch.tensor([0.1, 0.2]), torch.tensor([0.4])]
    # mean .5, unbiased std .70711: scores (.5, -.5) / .70711 = (.70711, -.70711)
    got = adv.grpo(rewards, [2, 1], 2, kl=kl, kl_coef=0.5)
    # KL return-to-go: (0.3, 0.2) and (0.4), times 0.5
    close(got[0], [0.70711 - 0.15, 0.70711 - 0.10], 1e-4)
    close(got[1], [-0.70711 - 0.20], 1e-4)


def test_returns_to_go_and_token_rewards() -> None:
    close(adv.returns_to_go(torch.tensor([1.0, 2.0, 4.0]), 0.5), [3.0, 4.0, 4.0])
    close(adv.token_rewards(2.0, 3), [0.0, 0.0, 2.0])
    close(adv.token_rewards(2.0, 3, torch.tensor([0.1, 0.2, 0.3]), 2.0), [-0.2, -0.4, 1.4])


def test_gae_by_hand() -> None:
    rewards, values = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.2, 0.4])
    # gamma .9, lam .8:
    #   t=2: delta = 1 - .4 = .6                    A = .6
    #   t=1: delta = .9 * .4 - .2 = .16             A = .16 + .72 * .6 = .592
    #   t=0: delta = .9 * .2 - .5 = -.32            A = -.32 + .72 * .592 = .10624
    a, ret = adv.gae(rewards, values, gamma=0.9, lam=0.8)
    close(a, [0.10624, 0.592, 0.6])
    close(ret, [0.60624, 0.792, 1.0])
    # gamma = lam = 1: A_t = (sum of rewards) - V_t, the Monte Carlo advantage
    a, ret = adv.gae(rewards, values, 1.0, 1.0)
    close(a, [0.5, 0.8, 0.6])
    close(ret, [1.0, 1.0, 1.0])
    # lam = 0: the one-step TD error
    a, _ = adv.gae(rewards, values, 1.0, 0.0)
    close(a, [-0.3, 0.2, 0.6])
    with pytest.raises(ValueError, match="rewards"):
        adv.gae(rewards, values[:2])


def test_reinforce_pp_whitens_returns_over_the_batch() -> None:
    got = adv.reinforce_pp([torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0, -1.0])])
    # returns (1, 1) and (-1, -1, -1): mean -.2, biased var (2 * 1.44 + 3 * .64) / 5 = .96
    std = math.sqrt(0.96)
    close(got[0], [1.2 / std] * 2, 1e-4)
    close(got[1], [-0.8 / std] * 3, 1e-4)
    flat = torch.cat(got)
    assert abs(float(flat.mean())) < 1e-6 and abs(float(flat.std(unbiased=False)) - 1) < 1e-4
