"""Truncated importance sampling (TIS) on the train/rollout mismatch, as verl, slime and
SkyRL ship it (Yao et al., "Your efficient RL framework secretly brings you off-policy RL
training", 2025).

The rollout engine (vLLM, a bf16 server, another kernel) samples from ``q``; the trainer
scores the same tokens as ``p_old``. The objective's ratio is taken against ``p_old`` (the
trainer's own log-probs, detached), and each token's advantage is weighted by
``min(p_old / q, cap)``: the off-policy correction for sampling from ``q``, truncated so that
a token the rollout found unlikely cannot dominate the step.
"""

from __future__ import annotations

import torch


def truncated_is(
    trainer_T: list[torch.Tensor], rollout_T: list[torch.Tensor], cap: float
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Per episode, each response token's weight ``min(exp(trainer - rollout), cap)``, and
    the step's ``tis_weight:mean``, ``tis_truncated:frac`` and ``tis_logprob_gap:max``."""
    if not cap > 0:
        raise ValueError(f"cap: must be > 0, got {cap}")
    raw_T = [
        torch.exp(t.detach().float() - r.float()) for t, r in zip(trainer_T, rollout_T, strict=True)
    ]
    weights_T = [w.clamp(max=cap) for w in raw_T]
    raw, weights = torch.cat(raw_T), torch.cat(weights_T)
    gaps = torch.cat(
        [(t.detach().float() - r.float()).abs() for t, r in zip(trainer_T, rollout_T, strict=True)]
    )
    metrics = {
        "tis_weight:mean": float(weights.mean()),
        "tis_truncated:frac": float((raw > cap).float().mean()),
        "tis_logprob_gap:max": float(gaps.max()),
    }
    return weights_T, metrics
