"""The PPO critic of the RL loop: a :class:`~furlong.models.critic.ValueModel` trained by a
TrainingEngine with the ``value`` objective (``furlong.train.objectives``), the same engine and
the same raw-sum semantics as the actor's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from furlong.models.critic import critic_from_policy
from furlong.rl.episodes import Episode
from furlong.train.engine import EngineConfig, TrainingEngine
from furlong.train.objectives import value_loss
from furlong.types import AdamParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from furlong.rl.config import RLConfig

INFO = {"role": "critic"}  # stored with its checkpoints: an actor checkpoint is refused by name


def build_critic(
    config: RLConfig, policy: PreTrainedModel, engine_config: EngineConfig
) -> TrainingEngine | None:
    """A critic on a copy of the policy's trunk with a fresh value head (``algo.advantage =
    "gae"``), else None. It trains with the run's engine settings, the actor's: its optimizer
    (kind, state store), prefix sharing and device."""
    if not config.uses_critic:
        return None
    model = critic_from_policy(policy, seed=config.run.seed).to(engine_config.device)
    return TrainingEngine(model, None, engine_config)


def critic_values(critic: TrainingEngine, episodes: list[Episode]) -> list[torch.Tensor]:
    """Per episode, float32 ``[len(datum)]``: value *i* is read at input position *i*."""
    data = [e.datum(dict.fromkeys(VALUE_INPUTS, torch.zeros(len(e.response)))) for e in episodes]
    return [o["values"] for o in critic.forward(data, "value").outputs]


VALUE_INPUTS = ("returns", "old_values", "weights")


def train_critic(
    config: RLConfig,
    critic: TrainingEngine,
    episodes: list[Episode],
    values_S: list[torch.Tensor],
    returns_T: list[torch.Tensor],
    minibatches: list[tuple[range, list[float]]],
) -> dict[str, float]:
    """One optimizer step per minibatch (episode indices, each one's per-token loss scale) on
    the clipped value loss around this step's values; the last minibatch's metrics, over the
    response tokens (those that carry loss)."""
    clip = config.critic.value_clip
    adam = AdamParams(learning_rate=config.critic.learning_rate)
    metrics: dict[str, float] = {}
    for part, scale in minibatches:
        data = [
            episodes[i].datum(
                {
                    "returns": returns_T[i],
                    "old_values": values_S[i][-len(returns_T[i]) :],
                    "weights": torch.full_like(returns_T[i], s),
                }
            )
            for i, s in zip(part, scale, strict=True)
        ]
        out = critic.forward_backward(data, "value", {"value_clip": clip or 0.0})
        critic.optim_step(adam)
        metrics = {"value_loss:sum": out.metrics["loss:sum"]}
        metrics |= _value_metrics(data, [o["values"] for o in out.outputs], clip)
        metrics["num_tokens:sum"] = out.metrics["num_tokens:sum"]
    return metrics


def _value_metrics(data: list, values: list[torch.Tensor], clip: float | None) -> dict[str, float]:
    """How often the clipped branch won, and the mean value, over tokens with weight."""
    x = {k: torch.cat([d.loss_fn_inputs[k] for d in data]) for k in VALUE_INPUTS}
    values_R = torch.cat(values)
    _, clipped_R = value_loss(values_R, x["returns"], x["old_values"], x["weights"], clip)
    on = x["weights"] != 0
    active = int(on.sum())
    return {
        "value_clipfrac:mean": int((clipped_R & on).sum()) / active if active else 0.0,
        "values:mean": float(values_R[on].sum()) / active if active else 0.0,
    }
