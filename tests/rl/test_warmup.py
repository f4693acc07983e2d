"""The warm-up's noisy teacher (warmup.decoy_share): what it shows, how often, and its refusals."""

from __future__ import annotations

import json
import random

import pytest
import torch

from furlong.errors import InputError
from furlong.rl.config import WarmupConfig
from furlong.rl.tasks import Problem, build_task, jsonl
from furlong.rl.warmup import _demonstration, supervised_warmup
from tests.train.helpers import engine, params


def test_built_in_decoys_are_the_plausible_mistakes() -> None:
    reverse = build_task("reverse", "exact_match", max_a=3)
    assert Problem("Reverse 3 8 1", "183", "381") in reverse.train + reverse.eval
    largest = build_task("largest", "exact_match", max_a=4)
    assert Problem("Which digit is largest: 3 8 1 5?", "8", "1") in largest.train + largest.eval


def test_the_teacher_shows_the_decoy_at_its_share() -> None:
    problem = Problem("Reverse 3 8 1", "183", "381")
    rng = random.Random(0)
    shown = [_demonstration(problem, 0.7, rng).answer for _ in range(4000)]
    assert set(shown) == {"183", "381"}
    assert shown.count("381") / len(shown) == pytest.approx(0.7, abs=0.02)
    # the prompt is the problem's own: only the demonstrated answer changes
    assert _demonstration(problem, 0.7, random.Random(1)).prompt == problem.prompt


def test_share_zero_leaves_the_problem_and_the_random_stream_alone() -> None:
    """Recipes without a decoy draw the same problems as before the option existed."""
    problem = Problem("Reverse 3 8 1", "183", "381")
    rng, untouched = random.Random(3), random.Random(3)
    assert all(_demonstration(problem, 0.0, rng) is problem for _ in range(10))
    assert rng.random() == untouched.random()


def test_a_task_without_decoys_is_refused_before_any_step() -> None:
    trainer = engine()
    before = params(trainer)
    task = build_task("addition", "exact_number", max_a=9, max_b=9)
    config = WarmupConfig(steps=2, batch_size=4, decoy_share=0.5)
    with pytest.raises(InputError, match="warmup.decoy_share: 0.5 needs a decoy.*'addition'"):
        supervised_warmup(trainer, task, config, random.Random(0))
    after = params(trainer)
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_jsonl_rows_may_carry_a_decoy(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [{"prompt": f"q{i}", "answer": str(i), "decoy": str(i + 1)} for i in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    train, held = jsonl(path)
    assert train[0] == Problem("q0", "0", "1") and held == [Problem("q9", "9", "10")]
