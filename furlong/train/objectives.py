"""The five Tinker objectives as per-token losses, summed raw per datum.

With ``lp`` the trainer's target log-probs, ``s`` the sampler's log-probs, ``r = exp(lp - s)``,
``A`` the advantages, ``w`` the weights and ``m`` the datum mask (1 real, 0 padding):

| loss_fn               | L_d                                  | config (default)               |
|-----------------------|--------------------------------------|--------------------------------|
| cross_entropy         | -sum m * w * lp                      | -                              |
| importance_sampling   | -sum m * r * A                       | -                              |
| ppo                   | -sum m * min(r A, clip(r, lo, hi) A) | clip_low/high_threshold 0.8/1.2|
| cispo                 | -sum m * sg(clip(r, lo, hi)) * lp * A| clip_low/high_threshold 0/4    |
| dro                   | -sum m * (lp A - beta/2 (lp - s)^2)  | beta 0.05                      |

Thresholds are absolute ratio bounds, not epsilons. Nothing here normalizes: the caller owns it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from furlong.errors import InputError

TokenLoss = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]


def _ratio(lp: torch.Tensor, x: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(lp - x["logprobs"])


def cross_entropy(lp: torch.Tensor, x: Mapping[str, torch.Tensor], cfg: Mapping[str, float]):
    return -x["weights"] * lp


def importance_sampling(lp: torch.Tensor, x: Mapping[str, torch.Tensor], cfg: Mapping[str, float]):
    return -_ratio(lp, x) * x["advantages"]


def ppo(lp: torch.Tensor, x: Mapping[str, torch.Tensor], cfg: Mapping[str, float]):
    ratio, adv = _ratio(lp, x), x["advantages"]
    clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.minimum(ratio * adv, clipped * adv)


def cispo(lp: torch.Tensor, x: Mapping[str, torch.Tensor], cfg: Mapping[str, float]):
    clipped = _ratio(lp, x).clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -clipped.detach() * lp * x["advantages"]


def dro(lp: torch.Tensor, x: Mapping[str, torch.Tensor], cfg: Mapping[str, float]):
    return -(lp * x["advantages"] - 0.5 * cfg["beta"] * (lp - x["logprobs"]) ** 2)


@dataclass(frozen=True)
class Objective:
    name: str
    token_loss: TokenLoss
    inputs: tuple[str, ...]  # per-token loss_fn_inputs read besides target_tokens
    defaults: Mapping[str, float] = field(default_factory=dict)
    top_k_targets: bool = False  # accepts [T, K] targets (the 2-D cross_entropy form)

    def resolve_config(self, config: Mapping[str, object] | None) -> dict[str, float]:
        """Defaults overlaid with the request's values; unknown keys are ignored (upstream)."""
        resolved = dict(self.defaults)
        for key, value in (config or {}).items():
            if key not in self.defaults:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InputError(f"loss_fn_config[{key!r}]: expected a number, got {value!r}")
            if not math.isfinite(value):
                raise InputError(f"loss_fn_config[{key!r}]: must be finite, got {value}")
            resolved[key] = float(value)
        lo, hi = resolved.get("clip_low_threshold"), resolved.get("clip_high_threshold")
        if lo is not None and hi is not None and not 0.0 <= lo <= hi:
            raise InputError(
                f"loss_fn_config: need 0 <= clip_low_threshold <= clip_high_threshold "
                f"(absolute ratio bounds), got {lo} and {hi}"
            )
        if resolved.get("beta", 0.0) < 0:
            raise InputError(f"loss_fn_config['beta']: must be >= 0, got {resolved['beta']}")
        return resolved


OBJECTIVES: dict[str, Objective] = {
    o.name: o
    for o in (
        Objective("cross_entropy", cross_entropy, ("weights",), top_k_targets=True),
        Objective("importance_sampling", importance_sampling, ("logprobs", "advantages")),
        Objective(
            "ppo",
            ppo,
            ("logprobs", "advantages"),
            {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        ),
        Objective(
            "cispo",
            cispo,
            ("logprobs", "advantages"),
            {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
        ),
        Objective("dro", dro, ("logprobs", "advantages"), {"beta": 0.05}),
    )
}


def get_objective(name: object) -> Objective:
    if not isinstance(name, str) or name not in OBJECTIVES:
        raise InputError(
            f"loss_fn: unknown objective {name!r}; expected one of {sorted(OBJECTIVES)}"
        )
    return OBJECTIVES[name]


def datum_losses(
    objective: Objective,
    config: Mapping[str, float],
    lp: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    mask: torch.Tensor,
    segment: torch.Tensor,
    num_datums: int,
) -> torch.Tensor:
    """Raw per-datum loss sums ``[num_datums]`` (fp32) from per-token rows.

    ``lp`` is ``[R]`` or ``[R, K]``; ``inputs`` hold the same shapes; ``mask`` ``[R]`` is the
    datum mask ``m``; ``segment`` ``[R]`` maps each row to its datum.
    """
    tokens = objective.token_loss(lp, inputs, config)
    if tokens.dim() == 2:
        tokens = tokens.sum(-1)
    tokens = tokens * mask
    return torch.zeros(num_datums, dtype=torch.float32, device=lp.device).index_add(
        0, segment, tokens.float()
    )
