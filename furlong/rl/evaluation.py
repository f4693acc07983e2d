"""Held-out evaluation: one code path for the RL loop's evaluations and ``furlong eval``.

Greedy accuracy is the mean verifier score of one greedy reply per problem (``solved``: the
share scoring 1, where a scorer gives partial credit); pass@1 the mean
over ``samples`` sampled replies per problem (the rollout's own temperature, fixed seeds, so
evaluations compare across steps); pass@k the unbiased estimator of Chen et al. (2021) from
the same draws, a draw counting as a pass when it scores 1. ``stopped`` is the share of greedy
replies that ended with the end token rather than at ``max_tokens``. Every reply comes back
too (:class:`Reply`), for ``samples.jsonl``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from furlong.rl.episodes import Episode, generate_episodes
from furlong.rl.tasks import Problem, Task
from furlong.rollout.base import RolloutEngine
from furlong.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SAMPLED_SEED = 12345  # the sampled draws' base seed: the same draws at every evaluation


@dataclass(frozen=True)
class Reply:
    """One evaluated (or trained-on) reply, as ``samples.jsonl`` holds it."""

    mode: str  # greedy | sampled | train
    prompt: str  # the problem's prompt (before the chat template)
    reference: str  # the problem's answer
    completion: str  # the reply, special tokens dropped
    extracted: str | None  # what task.extract found in it
    reward: float  # what RL learns from (the verifier plus the format term)
    correct: float  # the verifier's verdict alone
    stopped: bool  # ended with the end token

    @classmethod
    def of(cls, mode: str, episode: Episode) -> Reply:
        score = episode.score
        return cls(
            mode=mode,
            prompt=episode.problem.prompt,
            reference=episode.problem.answer,
            completion=episode.text,
            extracted=None if score is None else score.answer,
            reward=episode.reward,
            correct=episode.correct,
            stopped=episode.result.finish_reason == "stop",
        )

    def row(self, step: int) -> dict[str, Any]:
        return {"step": step, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class Evaluation:
    metrics: dict[str, float]  # eval_greedy, eval_solved, eval_stopped, eval_pass1, eval_pass@k
    replies: list[Reply]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of ``k`` draws out of ``n`` (``c`` correct) passes."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(
    rollout: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    problems: Sequence[Problem],
    params: SamplingParams,
    samples: int,
    pass_k: int = 0,
    seed: int = SAMPLED_SEED,
) -> Evaluation:
    """Greedy accuracy and stop rate, and with ``samples`` draws per problem pass@1 (and
    pass@``pass_k`` when it is > 1); draw ``i`` is sampled with seed ``seed + i``."""
    greedy = dataclasses.replace(params, temperature=0.0, top_k=0, top_p=1.0, seed=None)
    greedy = dataclasses.replace(greedy, return_sampling_mask=False)
    greedy_episodes = generate_episodes(rollout, tokenizer, problems, 1, greedy, task)
    replies = [Reply.of("greedy", e) for e in greedy_episodes]
    metrics = {
        "eval_greedy": _mean([r.correct for r in replies]),
        "eval_solved": _mean([float(r.correct >= 1.0) for r in replies]),  # no partial credit
        "eval_stopped": _mean([float(r.stopped) for r in replies]),
    }
    if samples:
        sampled = dataclasses.replace(params, seed=seed, return_sampling_mask=False)
        episodes = generate_episodes(rollout, tokenizer, problems, samples, sampled, task)
        drawn = [Reply.of("sampled", e) for e in episodes]
        metrics["eval_pass1"] = _mean([r.correct for r in drawn])
        if pass_k > 1:
            passes = [
                sum(r.correct >= 1.0 for r in drawn[i : i + samples])
                for i in range(0, len(drawn), samples)
            ]
            metrics[f"eval_pass@{pass_k}"] = _mean([pass_at_k(samples, c, pass_k) for c in passes])
        replies += drawn
    return Evaluation(metrics, replies)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
