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

A critic (a model with a value head, ``furlong.models.critic.ValueModel``) trains through the
same engine with the ``value`` objective, the only one a critic has (``VALUE_OBJECTIVES``).
With ``v`` its values, ``R`` the returns and ``o`` the old values,
``L_d = sum m * w * 1/2 * max((v - R)^2, (o + clip(v - o, -c, c) - R)^2)`` (``value_clip``
``c``, default 0.2; 0 turns clipping off: ``w * 1/2 * (v - R)^2``).
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


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    weights: torch.Tensor,
    clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token ``w·½·max((v−R)², (old + clamp(v−old, −c, c) − R)²)`` (``w·½·(v−R)²`` when
    ``clip`` is None), and where the clipped branch is strictly the larger one."""
    unclipped = (values - returns).square()
    if clip is None:
        return 0.5 * weights * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns).square()
    return 0.5 * weights * torch.maximum(unclipped, clipped), clipped > unclipped


def value(v: torch.Tensor, x: Mapping[str, torch.Tensor], cfg: Mapping[str, float]):
    clip = cfg["value_clip"] or None  # 0: off
    return value_loss(v, x["returns"], x["old_values"], x["weights"], clip)[0]


@dataclass(frozen=True)
class Objective:
    name: str
    token_loss: TokenLoss
    inputs: tuple[str, ...]  # per-token loss_fn_inputs read besides target_tokens
    defaults: Mapping[str, float] = field(default_factory=dict)
    top_k_targets: bool = False  # accepts [T, K] targets (the 2-D cross_entropy form)
    head: str = "policy"  # policy: log-probs of the targets (LM head); value: a value head

    @property
    def output(self) -> str:
        """The per-datum output the head produces: ``logprobs`` or ``values``."""
        return "values" if self.head == "value" else "logprobs"

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
        for key in ("beta", "value_clip"):
            if resolved.get(key, 0.0) < 0:
                raise InputError(f"loss_fn_config[{key!r}]: must be >= 0, got {resolved[key]}")
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
# what a critic (a value head instead of the LM head) trains with
VALUE_OBJECTIVES: dict[str, Objective] = {
    "value": Objective(
        "value", value, ("returns", "old_values", "weights"), {"value_clip": 0.2}, head="value"
    )
}


def get_objective(name: object, registry: Mapping[str, Objective] = OBJECTIVES) -> Objective:
    """``registry``: the objectives the model's head has (a critic's: ``VALUE_OBJECTIVES``)."""
    if not isinstance(name, str) or name not in registry:
        raise InputError(f"loss_fn: unknown objective {name!r}; expected one of {sorted(registry)}")
    return registry[name]


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

    ``lp`` is ``[R]`` or ``[R, K]`` (a critic's: its values ``[R]``); ``inputs`` hold the same
    shapes; ``mask`` ``[R]`` is the datum mask ``m``; ``segment`` ``[R]`` maps each row to its
    datum.
    """
    tokens = objective.token_loss(lp, inputs, config)
    if tokens.dim() == 2:
        tokens = tokens.sum(-1)
    tokens = tokens * mask
    return torch.zeros(num_datums, dtype=torch.float32, device=lp.device).index_add(
        0, segment, tokens.float()
    )
