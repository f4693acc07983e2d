"""The six Tinker objectives as per-token losses, summed raw per datum.

With ``lp`` the trainer's target log-probs, ``s`` the sampler's log-probs, ``r = exp(lp - s)``,
``A`` the advantages, ``w`` the weights and ``m`` the datum mask (1 real, 0 padding):

| loss_fn               | L_d                                  | config (default)               |
|-----------------------|--------------------------------------|--------------------------------|
| cross_entropy         | -sum m * w * lp                      | -                              |
| importance_sampling   | -sum m * r * A                       | -                              |
| ppo                   | -sum m * min(r A, clip(r, lo, hi) A) | clip_low/high_threshold 0.8/1.2|
| cispo                 | -sum m * sg(clip(r, lo, hi)) * lp * A| clip_low/high_threshold 0/4    |
| dro                   | -sum m * (lp A - beta/2 (lp - s)^2)  | beta 0.05                      |
| gspo                  | -sum m * min(q A, clip(q, lo, hi) A) | clip_low/high_threshold        |
|                       |                                      | 0.9997/1.0004                  |

GSPO-token (Zheng et al. 2025, "Group Sequence Policy Optimization", sec. 4.3, as Tinker's
docs define ``gspo``): the datum's sequence ratio is the geometric mean of its token ratios over
the tokens ``M`` that ``sequence_ratio_mask`` marks (nonzero), ``q_d = exp(mean_{t in M}
(lp_t - s_t))``, and every token carries its value with the gradient of its own log-prob:
``q_t = sg(q_d) * exp(lp_t - sg(lp_t))``, so ``dL/dlp_t = -q_d A_t`` where the unclipped term
is the min, else 0. The sum runs over every token (unmarked ones too, with their own ``A_t``);
the only division is the mean inside ``q_d``. The default thresholds are the paper's clipping
ranges 3e-4 / 4e-4 (Tinker's own defaults are unverified).

Thresholds are absolute ratio bounds, not epsilons. Nothing here normalizes: the caller owns it.
``loss_fn_config`` keys an objective does not take are refused, never ignored.

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

Inputs = Mapping[str, torch.Tensor]
Config = Mapping[str, float]
# (lp [R] or [R, K], inputs by name, config, segment [R]: each row's datum slot) -> per-row loss
TokenLoss = Callable[[torch.Tensor, Inputs, Config, torch.Tensor], torch.Tensor]


def _ratio(lp: torch.Tensor, x: Inputs) -> torch.Tensor:
    return torch.exp(lp - x["logprobs"])


def _clipped_objective(ratio: torch.Tensor, adv: torch.Tensor, cfg: Config) -> torch.Tensor:
    """``-min(ratio A, clip(ratio, lo, hi) A)``: PPO's token loss, and GSPO's on its ratio."""
    clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.minimum(ratio * adv, clipped * adv)


def cross_entropy(lp: torch.Tensor, x: Inputs, cfg: Config, segment: torch.Tensor) -> torch.Tensor:
    return -x["weights"] * lp


def importance_sampling(
    lp: torch.Tensor, x: Inputs, cfg: Config, segment: torch.Tensor
) -> torch.Tensor:
    return -_ratio(lp, x) * x["advantages"]


def ppo(lp: torch.Tensor, x: Inputs, cfg: Config, segment: torch.Tensor) -> torch.Tensor:
    return _clipped_objective(_ratio(lp, x), x["advantages"], cfg)


def cispo(lp: torch.Tensor, x: Inputs, cfg: Config, segment: torch.Tensor) -> torch.Tensor:
    clipped = _ratio(lp, x).clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -clipped.detach() * lp * x["advantages"]


def dro(lp: torch.Tensor, x: Inputs, cfg: Config, segment: torch.Tensor) -> torch.Tensor:
    return -(lp * x["advantages"] - 0.5 * cfg["beta"] * (lp - x["logprobs"]) ** 2)


def gspo(lp: torch.Tensor, x: Inputs, cfg: Config, segment: torch.Tensor) -> torch.Tensor:
    """GSPO-token: each row's ratio has its datum's sequence-ratio value and its own gradient."""
    marked = (x["sequence_ratio_mask"] != 0).to(lp.dtype)  # [R] 1 where the token is in M
    per_datum = torch.zeros_like(lp)  # [R] >= the datum slots, no sync
    log_ratio = per_datum.index_add(0, segment, (lp.detach() - x["logprobs"]) * marked)
    count = per_datum.index_add(0, segment, marked).clamp(min=1)  # 0 marked (padding): q = 1
    seq_log_ratio = (log_ratio / count)[segment]  # [R] sg(log q_d) on each of the datum's rows
    return _clipped_objective(torch.exp(seq_log_ratio + lp - lp.detach()), x["advantages"], cfg)


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


def value(v: torch.Tensor, x: Inputs, cfg: Config, segment: torch.Tensor) -> torch.Tensor:
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

    def resolve_config(
        self, config: Mapping[str, object] | None, where: str = "loss_fn_config"
    ) -> dict[str, float]:
        """Defaults overlaid with the request's values; a key the objective does not take is
        refused (a typo such as ``clip_lo`` must not train with the defaults). ``where`` names
        the config in messages (the RL config's is ``algo.objective_config``)."""
        resolved = dict(self.defaults)
        for key, value in (config or {}).items():
            if key not in self.defaults:
                takes = (
                    f"expected a subset of {sorted(self.defaults)}"
                    if self.defaults
                    else "it takes no loss_fn_config"
                )
                raise InputError(f"{where}: unknown key {key!r} for {self.name!r}; {takes}")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InputError(f"{where}[{key!r}]: expected a number, got {value!r}")
            if not math.isfinite(value):
                raise InputError(f"{where}[{key!r}]: must be finite, got {value}")
            resolved[key] = float(value)
        lo, hi = resolved.get("clip_low_threshold"), resolved.get("clip_high_threshold")
        if lo is not None and hi is not None and not 0.0 <= lo <= hi:
            raise InputError(
                f"{where}: need 0 <= clip_low_threshold <= clip_high_threshold "
                f"(absolute ratio bounds), got {lo} and {hi}"
            )
        for key in ("beta", "value_clip"):
            if resolved.get(key, 0.0) < 0:
                raise InputError(f"{where}[{key!r}]: must be >= 0, got {resolved[key]}")
        return resolved


RL_INPUTS = ("logprobs", "advantages")
OBJECTIVES: dict[str, Objective] = {
    o.name: o
    for o in (
        Objective("cross_entropy", cross_entropy, ("weights",), top_k_targets=True),
        Objective("importance_sampling", importance_sampling, RL_INPUTS),
        Objective("ppo", ppo, RL_INPUTS, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        Objective(
            "cispo", cispo, RL_INPUTS, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
        ),
        Objective("dro", dro, RL_INPUTS, {"beta": 0.05}),
        Objective(
            "gspo",
            gspo,
            (*RL_INPUTS, "sequence_ratio_mask"),
            {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
        ),
    )
}
# what a critic (a value head instead of the LM head) trains with
VALUE_OBJECTIVES: dict[str, Objective] = {
    "value": Objective(
        "value", value, ("returns", "old_values", "weights"), {"value_clip": 0.2}, head="value"
    )
}
# Tinker's LossFnType names furlong does not implement: refused by name, with what to use
UNSUPPORTED: dict[str, str] = {
    "stable_reinforce": "use importance_sampling, ppo, cispo, dro or gspo",
    "custom": "a custom loss runs client-side: forward_backward_custom sends cross_entropy",
}


def get_objective(name: object, registry: Mapping[str, Objective] = OBJECTIVES) -> Objective:
    """``registry``: the objectives the model's head has (a critic's: ``VALUE_OBJECTIVES``)."""
    if isinstance(name, str) and name in registry:
        return registry[name]
    if isinstance(name, str) and name in UNSUPPORTED:
        raise InputError(
            f"loss_fn: {name!r} is not supported by furlong ({UNSUPPORTED[name]}); "
            f"expected one of {sorted(registry)}"
        )
    raise InputError(f"loss_fn: unknown objective {name!r}; expected one of {sorted(registry)}")


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
    tokens = objective.token_loss(lp, inputs, config, segment)
    if tokens.dim() == 2:
        tokens = tokens.sum(-1)
    tokens = tokens * mask
    return torch.zeros(num_datums, dtype=torch.float32, device=lp.device).index_add(
        0, segment, tokens.float()
    )
