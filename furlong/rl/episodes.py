"""Episodes: one sampled response to one prompt, and the datums the trainers learn from.

A datum's ``model_input`` is ``(prompt + response)[:-1]`` and its targets ``[1:]``, so the
response occupies the last ``len(response)`` target positions; prompt positions carry zero
advantage and weight. Sampling masks cover exactly those response positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from furlong.rl.tasks import Problem, Score, Task
from furlong.rollout.base import GenerateResult, RolloutEngine
from furlong.rollout.sampling import SamplingParams
from furlong.train.objectives import OBJECTIVES
from furlong.types import Datum

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def render_prompt(tokenizer: PreTrainedTokenizerBase, text: str, system: str = "") -> list[int]:
    """The user's message (after ``system``, if any) in the chat template, ready for the
    assistant's turn."""
    messages = [{"role": "system", "content": system}] if system else []
    rendered = tokenizer.apply_chat_template(
        [*messages, {"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(rendered)["input_ids"]


@dataclass
class Episode:
    problem: Problem
    result: GenerateResult
    text: str  # the decoded response (special tokens dropped)
    reward: float = 0.0
    score: Score | None = None  # the task's verdict (reward, correct, answer, stopped)

    @property
    def correct(self) -> float:
        """The verifier's value without the format term."""
        return self.reward if self.score is None else self.score.correct

    @property
    def prompt(self) -> list[int]:
        return self.result.prompt_ids

    @property
    def response(self) -> list[int]:
        return self.result.output_ids

    @cached_property
    def logprobs_T(self) -> torch.Tensor:
        """The rollout's log-prob of each response token, under the distribution it sampled
        from (float32 ``[len(response)]``)."""
        return torch.tensor(self.result.output_logprobs)

    def datum(self, inputs: dict[str, torch.Tensor]) -> Datum:
        """``inputs`` hold response-length tensors; prompt positions are zero-filled."""
        return Datum.next_token(self.prompt + self.response, **inputs)

    def actor_datum(
        self, objective: str, advantages_T: torch.Tensor, behaviour_T: torch.Tensor | None = None
    ) -> Datum:
        """What the actor's ``objective`` reads: the behaviour log-probs (the rollout's, or
        ``behaviour_T``: the trainer's own under rollout correction) and ``advantages_T`` on
        the response, and for a sequence ratio (gspo) the response tokens as its mask."""
        behaviour = self.logprobs_T if behaviour_T is None else behaviour_T
        inputs = {"logprobs": behaviour, "advantages": advantages_T}
        if "sequence_ratio_mask" in OBJECTIVES[objective].inputs:
            inputs["sequence_ratio_mask"] = torch.ones_like(self.logprobs_T)
        return self.datum(inputs)


def generate_episodes(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    group_size: int,
    params: SamplingParams,
    task: Task,
) -> list[Episode]:
    """``group_size`` samples per problem (consecutive), scored by the task's verifier."""
    prompts = [render_prompt(tokenizer, p.prompt, task.system) for p in problems]
    seed = params.seed
    per_sample = [
        dataclasses.replace(params, seed=None if seed is None else seed + i)
        for i in range(len(problems) * group_size)
    ]
    results = engine.generate([p for p in prompts for _ in range(group_size)], per_sample)
    episodes = []
    for i, result in enumerate(results):
        problem = problems[i // group_size]
        text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence decodes to one string
        score = task.score(text, problem, stopped=result.finish_reason == "stop")
        episodes.append(Episode(problem, result, text, score.reward, score))
    return episodes
