"""reasoning-gym as a task source: ``task.name = "reasoning_gym:<dataset>"``.

The generator gets ``task.config`` (its own fields: ``size``, ``seed`` and the difficulty knobs,
e.g. ``chain_sum``'s ``min_terms`` / ``max_digits``). A stable fifth of all questions (by a
hash of the question) is held out: the train split is the dataset built with them, less
those; the held-out split is the same generator under another seed (``seed + HELD_OUT_SEED``),
its first ``task.eval_size`` questions (200 by default) in that fifth, each once. The two never
share an item, however small the generator's space (``chain_sum`` with two 1-digit terms has
200). The reward is the dataset's own ``score_answer`` on the answer ``task.extract`` finds
(``answer_tag`` by default, reasoning-gym's convention). ``task.template`` wraps the question
(``"{question}"``; ``{answer}`` is never offered).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import reasoning_gym
from reasoning_gym.factory import DATASETS

from furlong.errors import InputError, did_you_mean
from furlong.rl.tasks import Problem, stably_held_out

PREFIX = "reasoning_gym:"  # task_sources.REASONING_GYM
HELD_OUT_SHARE = 0.2
HELD_OUT_SEED = 1_000_003  # the held-out generator's seed offset: a prime far from any size
DEFAULT_EVAL_SIZE = 200
DEFAULT_TRAIN_SIZE = 1000


def dataset_name(name: str) -> str:
    return name.removeprefix(PREFIX)


def check(name: str) -> None:
    """Config time: the dataset exists."""
    dataset = dataset_name(name)
    if dataset not in DATASETS:
        raise InputError(
            f"task.name: reasoning-gym has no dataset {dataset!r} ({len(DATASETS)} known, "
            "e.g. chain_sum, basic_arithmetic, letter_counting)" + did_you_mean(dataset, DATASETS)
        )


class ReasoningGymScorer:
    """The dataset's ``score_answer`` on a problem's entry (its ``metadata``)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self, answer: str, problem: Problem) -> float:
        return float(self.dataset.score_answer(answer, entry=dict(problem.metadata)))


def build(
    name: str, config: Mapping[str, Any], eval_size: int, template: str
) -> tuple[list[Problem], list[Problem], ReasoningGymScorer]:
    """(train, held-out, the dataset's scorer) of a checked name (:func:`check`);
    ``eval_size`` 0: :data:`DEFAULT_EVAL_SIZE`."""
    dataset = dataset_name(name)
    settings = {"size": DEFAULT_TRAIN_SIZE, "seed": 0} | dict(config)
    want = eval_size or DEFAULT_EVAL_SIZE
    # drawn over: only the held-out fifth's questions are kept, each once
    held_settings = settings | {"seed": int(settings["seed"]) + HELD_OUT_SEED, "size": 10 * want}
    try:
        train_set = reasoning_gym.create_dataset(dataset, **settings)
        held_set = reasoning_gym.create_dataset(dataset, **held_settings)
    except (TypeError, ValueError, AssertionError) as e:  # an unknown knob, a bad range
        raise InputError(f"task.config: reasoning-gym's {dataset!r} refused {settings}: {e}") from e
    train = [_problem(e, template) for e in train_set if not held_out(e["question"])]
    asked = {p.metadata["question"] for p in train}
    held: list[Problem] = []
    for entry in held_set:
        if len(held) == want:
            break
        if held_out(entry["question"]) and entry["question"] not in asked:
            asked.add(entry["question"])
            held.append(_problem(entry, template))
    if not held:
        raise InputError(
            f"task.config: every held-out question of {dataset!r} is also in the train split "
            f"({len(train)} items); the configuration has too few distinct problems: widen it"
        )
    if not train:
        raise InputError(f"task.config: every question of {dataset!r} fell in the held-out fifth")
    return train, held, ReasoningGymScorer(train_set)


def held_out(question: str) -> bool:
    """A stable fifth of the questions is held out whichever seed draws them."""
    return stably_held_out(question, HELD_OUT_SHARE)


def _problem(entry: Mapping[str, Any], template: str) -> Problem:
    question = str(entry["question"])
    prompt = template.format(question=question) if template else question
    return Problem(prompt, str(entry["answer"]), metadata=dict(entry))
