"""``algo.objective = "gspo"``: selectable with its clip bounds, and the actor's datums carry
the response as the sequence-ratio mask (prompt positions 0), so the loop trains with it."""

from __future__ import annotations

import math

import pytest
import torch

from furlong.errors import InputError
from furlong.rl.config import load_config
from furlong.rl.episodes import Episode
from furlong.rl.loop import _train_actor
from furlong.rl.tasks import Problem
from furlong.rollout.base import GenerateResult
from tests.train.helpers import engine, params

pytestmark = pytest.mark.usefixtures("one_thread")


def test_gspo_is_an_actor_objective_with_clip_bounds() -> None:
    config = load_config(None, ["algo.objective=gspo", "algo.clip_low=0.99", "algo.clip_high=1.02"])
    assert config.loss_fn_config == {"clip_low_threshold": 0.99, "clip_high_threshold": 1.02}
    assert load_config(None, ["algo.objective=gspo"]).loss_fn_config == {}  # the defaults
    with pytest.raises(InputError, match="algo.dro_beta: only for algo.objective = 'dro'"):
        load_config(None, ["algo.objective=gspo", "algo.dro_beta=0.1"])
    with pytest.raises(InputError, match=r"unknown 'stable_reinforce'; expected one of .*'gspo'"):
        load_config(None, ["algo.objective=stable_reinforce"])


def episode(prompt: list[int], response: list[int], logprobs: list[float]) -> Episode:
    result = GenerateResult(0, prompt, response, logprobs, "stop", None, 0)
    return Episode(Problem("p", "a"), result, "text", 1.0)


def test_the_actor_step_builds_gspo_datums_and_trains() -> None:
    episodes = [
        episode([5, 9, 13, 21], [30, 31, 32], [-6.1, -6.9, -7.3]),
        episode([5, 9, 17], [40, 41], [-6.4, -5.8]),
    ]
    datum = episodes[0].actor_datum("gspo", torch.tensor([0.5, 0.5, 0.5]))
    # targets = (prompt + response)[1:]: 3 prompt positions, then the 3 response tokens
    assert datum.loss_fn_inputs["sequence_ratio_mask"].tolist() == [0, 0, 0, 1, 1, 1]
    assert datum.loss_fn_inputs["advantages"].tolist() == [0, 0, 0, 0.5, 0.5, 0.5]
    assert "sequence_ratio_mask" not in episodes[0].actor_datum("ppo", torch.ones(3)).loss_fn_inputs

    config = load_config(None, ["algo.objective=gspo", "algo.clip_low=0.5", "algo.clip_high=2"])
    actor = engine()
    before = params(actor)
    advantages = [torch.full((3,), 1.0), torch.full((2,), -1.0)]
    metrics = _train_actor(config, actor, episodes, advantages)
    assert math.isfinite(metrics["actor_loss:sum"]) and metrics["actor_skipped:sum"] == 0.0
    assert metrics["grad_norm:mean"] > 0
    assert any(not torch.equal(before[n], p) for n, p in params(actor).items())
