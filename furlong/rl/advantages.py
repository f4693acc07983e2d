"""Advantage estimators: GRPO (group-relative), GAE from a critic, REINFORCE++.

Every function works on per-sequence tensors over the *response* tokens only. A sequence's
outcome reward lands on its last token; an optional KL penalty to a frozen reference is a
per-token reward ``-kl_coef * (logp_sampler - logp_ref)`` on every response token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def token_rewards(
    reward: float, length: int, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Per-token rewards ``[length]``: the outcome on the last token, minus the KL penalty."""
    out = torch.zeros(length, dtype=torch.float32)
    out[-1] = reward
    if kl is not None and kl_coef:
        out = out - kl_coef * kl.float()
    return out


def returns_to_go(rewards: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` with ``G_T = 0``."""
    out = torch.empty_like(rewards)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t]) + gamma * running
        out[t] = running
    return out


def group_relative(
    rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, divided by the group's (unbiased) std when
    ``scale_by_std``. Consecutive ``group_size`` entries form a group (one prompt)."""
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def grpo(
    rewards: torch.Tensor,
    lengths: Sequence[int],
    group_size: int,
    scale_by_std: bool = True,
    kl: Sequence[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
) -> list[torch.Tensor]:
    """Per-token GRPO advantages: the sequence's group-relative score on every token, minus
    the KL penalty's return-to-go (KL in the reward, undiscounted)."""
    scores = group_relative(rewards, group_size, scale_by_std)
    out = []
    for i, n in enumerate(lengths):
        adv = torch.full((n,), float(scores[i]))
        if kl is not None and kl_coef:
            adv = adv - kl_coef * returns_to_go(kl[i].float())
        out.append(adv)
    return out


def gae(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over one response.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` (``V_T = 0``: the episode ends with the response),
    ``A_t = delta_t + gamma * lam * A_{t+1}``; returns ``(A, A + V)`` (the critic's targets)."""
    if rewards.shape != values.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} vs values {tuple(values.shape)}")
    values = values.float()
    advantages = torch.empty_like(values)
    running, next_value = 0.0, 0.0
    for t in range(len(values) - 1, -1, -1):
        delta = float(rewards[t]) + gamma * next_value - float(values[t])
        running = delta + gamma * lam * running
        advantages[t] = running
        next_value = float(values[t])
    return advantages, advantages + values


def whiten(xs: Sequence[torch.Tensor], eps: float = 1e-6) -> list[torch.Tensor]:
    """Normalize across every token of the batch: zero mean, unit (biased) std."""
    flat = torch.cat([x.float() for x in xs])
    mean, std = flat.mean(), flat.std(unbiased=False)
    return [(x.float() - mean) / (std + eps) for x in xs]


def reinforce_pp(token_rewards_: Sequence[torch.Tensor], gamma: float = 1.0) -> list[torch.Tensor]:
    """REINFORCE++: per-token returns-to-go (KL already in the token rewards), whitened over
    the whole batch instead of per group."""
    return whiten([returns_to_go(r, gamma) for r in token_rewards_])
