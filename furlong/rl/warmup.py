"""Supervised warm-up on a task's train problems in chat form."""

from __future__ import annotations

import dataclasses
import random
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from furlong.errors import InputError
from furlong.metrics import Heartbeat, MetricsLog
from furlong.rl.config import WarmupConfig
from furlong.rl.episodes import render_prompt
from furlong.rl.tasks import Problem, Task
from furlong.train.engine import TrainingEngine
from furlong.types import AdamParams, Datum

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def sft_datum(
    tokenizer: PreTrainedTokenizerBase, problem: Problem, scale: float = 1.0, system: str = ""
) -> Datum:
    """The chat-formatted problem with its answer; weight ``scale`` on the answer tokens."""
    prompt = render_prompt(tokenizer, problem.prompt, system)
    answer = answer_ids(tokenizer, problem)
    return Datum.next_token(prompt + answer, weights=torch.full((len(answer),), scale))


def answer_ids(tokenizer: PreTrainedTokenizerBase, problem: Problem) -> list[int]:
    return tokenizer(problem.answer + tokenizer.eos_token)["input_ids"]


def supervised_warmup(
    engine: TrainingEngine,
    task: Task,
    config: WarmupConfig,
    rng: random.Random,
    progress: bool = False,
    log: MetricsLog | None = None,
) -> list[float]:
    """``config.steps`` cross-entropy steps; the client-side normalization is per answer token.
    Returns the per-step mean loss; ``log`` gets each step's ``{"loss": ...}`` (steps from 1)
    as the step finishes, so a crash keeps the steps done. Without ``progress`` bars a line
    every ``HEARTBEAT_SECONDS`` says how far it is."""
    if config.decoy_share and not all(p.decoy for p in task.train):
        raise InputError(
            f"warmup.decoy_share: {config.decoy_share} needs a decoy answer for every problem; "
            f"task {task.name!r} has none (built in: reverse, largest; jsonl: a 'decoy' field)"
        )
    adam = AdamParams(learning_rate=config.learning_rate)
    losses = []
    bar = tqdm(range(1, config.steps + 1), desc="warm-up", disable=not progress)
    heartbeat = None if progress else Heartbeat("warm-up", config.steps)
    for step in bar:
        problems = [
            _demonstration(p, config.decoy_share, rng) for p in task.sample(config.batch_size, rng)
        ]
        total = sum(len(answer_ids(engine.tokenizer, p)) for p in problems)
        batch = [sft_datum(engine.tokenizer, p, 1.0 / total, task.system) for p in problems]
        out = engine.forward_backward(batch, "cross_entropy")
        engine.optim_step(adam)
        losses.append(out.metrics["loss:sum"])
        if log is not None:
            log.write(step, {"loss": losses[-1]})
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if heartbeat is not None:
            heartbeat.tick(step, f"loss {losses[-1]:.3f}")
    return losses


def _demonstration(problem: Problem, decoy_share: float, rng: random.Random) -> Problem:
    """The problem as the teacher shows it: its decoy in place of the answer, now and then."""
    if decoy_share and rng.random() < decoy_share:
        return dataclasses.replace(problem, answer=problem.decoy)
    return problem
