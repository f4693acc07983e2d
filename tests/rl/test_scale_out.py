"""The RL loop with a multi-rank trainer (``furlong train ... --trainer-ranks 2``): rank 0's
weights reach the in-process rollout engine every step (trainer and rollout log-probs agree),
sampling masks cross the process boundary, the policy is exported; bad scale settings are
refused before anything starts; Ray placement plans."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

from furlong.cli import main
from furlong.errors import InputError
from furlong.rl.placement import plan
from furlong.rl.scale import ScaleOut


def test_train_with_two_trainer_ranks(tmp_path, short_reward, capsys) -> None:
    overrides = [
        "model.name=tiny-qwen3",
        "task.reward=short_text",
        "task.eval_size=4",
        "task.eval_samples=0",
        "rollout.prompts_per_step=2",
        "rollout.group_size=3",
        "rollout.max_tokens=5",
        "rollout.top_p=0.9",
        "run.steps=3",
        "run.eval_every=3",
        "run.progress=false",
        f"run.out_dir={tmp_path}",
    ]
    assert main(["train", *overrides, "--trainer-ranks", "2"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows[1:]:  # the rollout scored with the weights the ranks trained (fp32: ~1e-6)
        assert row["logprob_diff:mean"] < 1e-4
        assert row["grad_norm:mean"] > 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    assert model.config.hidden_size == 64
    assert "held-out after RL" in capsys.readouterr().out


@pytest.mark.parametrize(
    "scale,colocation,match",
    [
        (ScaleOut(trainer_ranks=0), False, "scale.trainer_ranks"),
        (ScaleOut(rollout_engines=2), False, "need Ray"),
        (ScaleOut(trainer_ranks=2), True, "colocate.enabled"),
    ],
)
def test_bad_scale_is_refused(scale: ScaleOut, colocation: bool, match: str) -> None:
    with pytest.raises(InputError, match=match):
        scale.check(colocation)


def test_placement_plans() -> None:
    apart = plan(2, 1, colocate=False)
    assert apart.bundles == [{"CPU": 1.0}] * 3
    assert (apart.trainers, apart.engines, apart.resources(2)) == ([0, 1], [2], {"CPU": 1.0})
    shared = plan(2, 1, colocate=True, gpus=True)
    assert shared.bundles == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert (shared.trainers, shared.engines) == ([0, 1], [0])
    assert shared.resources(0) == {"CPU": 0.5, "GPU": 0.5}
    with pytest.raises(InputError, match="scale.rollout_engines"):
        plan(1, 0, colocate=False)
