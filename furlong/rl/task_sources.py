"""A run's task from its ``[task]`` table: the built-in generators and plug-ins
(``furlong.rl.tasks``), reasoning-gym (``reasoning_gym:<dataset>``) and HF datasets
(``datasets:<file, directory or cached name>``), with the answer extraction, the format reward
and, before training, the check that no constant reply earns the reward.
"""

from __future__ import annotations

import string
import warnings
from collections import Counter
from typing import TYPE_CHECKING, Any

from furlong.errors import InputError
from furlong.extras import require
from furlong.rl.extract import resolve_extract, wrap
from furlong.rl.tasks import Problem, Task, build_task, check_task, resolve_reward

if TYPE_CHECKING:
    from furlong.rl.config import TaskConfig

# the sources' prefixes; their modules import their libraries (the tasks extra), so they are
# imported only once a task names them
REASONING_GYM = "reasoning_gym:"
DATASETS = "datasets:"

CONSTANT_SHARE = 0.10  # a constant reply earning more than this mean reward is a gamed reward
CONSTANTS = ("", "0", "1", "-1", "yes", "no", "Yes", "No", "True", "False", "A", "B")
CHECKED = 200  # train problems the constant replies are scored on
CHECKS = ("auto", "refuse", "warn", "off")


def source_of(name: str) -> str:
    """``reasoning_gym``, ``datasets`` or ``tasks`` (a built-in, JSONL or plug-in task)."""
    if name.startswith(REASONING_GYM):
        return "reasoning_gym"
    if name.startswith(DATASETS):
        return "datasets"
    return "tasks"


def _source_module(name: str) -> Any:
    """The source's module, once its part of the extra is known to be installed."""
    if source_of(name) == "reasoning_gym":
        require("tasks", f"task.name = {name!r}", ("reasoning_gym",))
        from furlong.rl import reasoning_gym_task

        return reasoning_gym_task
    require("tasks", f"task.name = {name!r}", ("datasets",))
    from furlong.rl import datasets_task

    return datasets_task


def check_task_config(t: TaskConfig) -> None:
    """Config time, before anything loads: names, fields and the extra the source needs."""
    source = source_of(t.name)
    if t.constant_check not in CHECKS:
        raise InputError(f"task.constant_check: unknown {t.constant_check!r}; expected {CHECKS}")
    resolve_extract(extract_name(t))
    if t.format_reward < 0:
        raise InputError(f"task.format_reward: must be >= 0, got {t.format_reward}")
    if t.eval_pass_k < 0 or t.eval_pass_k > max(t.eval_samples, 1):
        raise InputError(
            f"task.eval_pass_k: {t.eval_pass_k} needs task.eval_samples >= it "
            f"(got {t.eval_samples} draws per problem)"
        )
    if t.args and (source != "tasks" or ":" not in t.name):
        raise InputError("task.args: only a plug-in task ('module:function') takes arguments")
    if source == "tasks":
        check_task(t.name, t.reward, t.path)
        for field, value in (("task.config", t.config), ("task.template", t.template)):
            if value:
                raise InputError(f"{field}: only for reasoning_gym: and datasets: tasks")
        return
    _source_module(t.name).check(t.name)
    if source == "reasoning_gym":
        _check_template(t.template, {"question"})
        if t.reward != "auto":
            resolve_reward(t.reward)
    else:
        if t.config:
            raise InputError("task.config: only for reasoning_gym: tasks (datasets: a file)")
        resolve_reward(t.reward)


def _check_template(template: str, fields: set[str]) -> None:
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        raise InputError(f"task.template: {e} in {template!r}") from None
    unknown = sorted(names - fields)
    if unknown:
        raise InputError(
            f"task.template: {{{unknown[0]}}} is not a field here; expected {sorted(fields)}"
        )


def make_task(t: TaskConfig) -> Task:
    """The task ``t`` names, checked against constant replies (``task.constant_check``)."""
    check_task_config(t)
    source = source_of(t.name)
    if source == "reasoning_gym":
        train, held, scorer = _source_module(t.name).build(
            t.name, t.config, t.eval_size, t.template
        )
        verifier = scorer if t.reward == "auto" else resolve_reward(t.reward)
    elif source == "datasets":
        train, held = _source_module(t.name).build(
            t.name,
            t.prompt_field,
            t.answer_field,
            t.template,
            lambda f: _check_template(t.template, f),
        )
        verifier = resolve_reward(t.reward)
    else:
        built = build_task(t.name, t.reward, t.path, t.max_a, t.max_b, t.args)
        train, held, verifier = built.train, built.eval, built.reward
    extract = extract_name(t)
    task = Task(t.name, train, held, verifier, resolve_extract(extract), t.format_reward, t.system)
    mode = t.constant_check
    if mode == "auto":  # the built-ins are known; a plug-in's stub rewards are its own call
        mode = "off" if source == "tasks" else "refuse"
    if mode != "off":
        check_constants(task, extract, mode)
    return task


def extract_name(t: TaskConfig) -> str:
    """``task.extract``, ``auto`` resolved: ``answer_tag`` for reasoning-gym, else ``whole``."""
    if t.extract != "auto":
        return t.extract
    return "answer_tag" if source_of(t.name) == "reasoning_gym" else "whole"


def constant_scores(task: Task, extract: str) -> dict[str, float]:
    """The mean verifier score of each constant reply over the first :data:`CHECKED` train
    problems, and of the train split's most common answer (a majority-class guess) over the
    held-out problems (scored where it was not counted, so a small split does not flatter it)."""

    def mean(reply: str, problems: list[Problem]) -> float:
        return sum(task.score(wrap(reply, extract), p).correct for p in problems) / len(problems)

    scores = {c: mean(c, task.train[:CHECKED]) for c in CONSTANTS}
    common = Counter(p.answer for p in task.train).most_common(1)[0][0]
    scores[common] = max(scores.get(common, 0.0), mean(common, task.eval[:CHECKED]))
    return scores


def check_constants(task: Task, extract: str, mode: str) -> None:
    """Refuse (``mode = "refuse"``) or warn when a constant reply earns > 10% of the reward."""
    scores = constant_scores(task, extract)
    gamed = {c: s for c, s in scores.items() if s > CONSTANT_SHARE}
    if not gamed:
        return
    worst = max(gamed, key=lambda c: gamed[c])
    message = (
        f"task.name: {task.name!r}: the constant reply {worst!r} earns {gamed[worst]:.0%} of the "
        f"reward on the train split ({len(gamed)} constant replies earn > "
        f"{CONSTANT_SHARE:.0%}: {', '.join(repr(c) for c in gamed)}); a reward a constant "
        "earns teaches little. Pick another task or configuration, or set "
        "task.constant_check = 'warn' to train anyway"
    )
    if mode == "refuse":
        raise InputError(message)
    warnings.warn(message, stacklevel=2)


def held_out(task: Task, t: TaskConfig) -> list[Problem]:
    """The problems an evaluation scores: the first ``task.eval_size`` held-out ones (all: 0)."""
    return task.eval[: t.eval_size] if t.eval_size else task.eval
