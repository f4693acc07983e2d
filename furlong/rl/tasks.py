"""Tasks and rewards: a task is a problem set (train / held-out split) plus a verifier.

Built-in: ``addition``, ``largest`` and ``reverse`` (synthetic and verifiable; a stable fifth
held out by hash) and ``jsonl`` (``{"prompt": ..., "answer": ...}`` per line, an optional
``"split": "train" | "eval"``; without it every tenth line is held out; an optional ``"decoy"``,
a plausible wrong answer for ``warmup.decoy_share``).
Rewards are looked up by name in :data:`REWARDS`.

Plug-ins, slime-style: a ``task.name`` or ``task.reward`` holding a ``:`` is a function path
``"module:function"``. The module is imported with :func:`importlib.import_module` (a dotted
name on ``sys.path``; the working directory is searched last, so a ``my_reward.py`` beside the
run works under the ``furlong`` script too):

- reward: ``score(response: str, problem: Problem) -> float``, like :data:`REWARDS`' entries;
- task: ``problems(*, path: str, max_a: int, max_b: int) -> (train, eval)``, two non-empty
  lists of :class:`Problem`, like the built-in generators (``addition``, ``jsonl``).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import numbers
import os
import random
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from furlong.errors import InputError


@dataclass(frozen=True)
class Problem:
    prompt: str  # the user's message (rendered with the chat template by the loop)
    answer: str  # what the verifier compares against
    # a plausible wrong answer (reverse: the digits echoed), which a noisy warm-up teacher
    # shows instead of the answer (warmup.decoy_share); "" where the task has none
    decoy: str = ""


Verifier = Callable[[str, Problem], float]
_NUMBER = re.compile(r"-?\d+")


def exact_number(response: str, problem: Problem) -> float:
    """1 when the first number in the response equals the answer, else 0."""
    found = _NUMBER.search(response)
    return float(found is not None and found.group() == problem.answer.strip())


def exact_match(response: str, problem: Problem) -> float:
    """1 when the stripped response equals the stripped answer."""
    return float(response.strip() == problem.answer.strip())


def contains(response: str, problem: Problem) -> float:
    return float(problem.answer.strip() in response)


REWARDS: dict[str, Verifier] = {
    "exact_number": exact_number,
    "exact_match": exact_match,
    "contains": contains,
}


@dataclass(frozen=True)
class Task:
    name: str
    train: list[Problem]
    eval: list[Problem]
    reward: Verifier

    def sample(self, n: int, rng: random.Random) -> list[Problem]:
        return [rng.choice(self.train) for _ in range(n)]


def _held_out(key: str, share: float) -> bool:
    """A stable split: the same problem is always on the same side."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < share


def addition(
    max_a: int = 99, max_b: int = 9, held_out: float = 0.2
) -> tuple[list[Problem], list[Problem]]:
    """``What is a + b?`` for 0 <= a <= max_a, 0 <= b <= max_b; held-out pairs never train."""
    train: list[Problem] = []
    held: list[Problem] = []
    for a in range(max_a + 1):
        for b in range(max_b + 1):
            problem = Problem(f"What is {a} + {b}?", str(a + b))
            (held if _held_out(f"{a}+{b}", held_out) else train).append(problem)
    return train, held


def largest(count: int = 4, held_out: float = 0.2) -> tuple[list[Problem], list[Problem]]:
    """``Which digit is largest: 3 8 1 5?`` over every string of ``count`` digits."""
    train: list[Problem] = []
    held: list[Problem] = []
    for n in range(10**count):
        digits = f"{n:0{count}d}"
        prompt = f"Which digit is largest: {' '.join(digits)}?"
        problem = Problem(prompt, max(digits), decoy=min(digits))
        (held if _held_out(digits, held_out) else train).append(problem)
    return train, held


def reverse(count: int = 3, held_out: float = 0.2) -> tuple[list[Problem], list[Problem]]:
    """``Reverse 3 8 1`` -> ``183`` over every string of ``count`` digits."""
    train: list[Problem] = []
    held: list[Problem] = []
    for n in range(10**count):
        digits = f"{n:0{count}d}"
        problem = Problem(f"Reverse {' '.join(digits)}", digits[::-1], decoy=digits)
        (held if _held_out(digits, held_out) else train).append(problem)
    return train, held


def jsonl(path: str | Path) -> tuple[list[Problem], list[Problem]]:
    train: list[Problem] = []
    held: list[Problem] = []
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:  # gone since the config was checked, or binary
        raise InputError(f"task.path: cannot read {str(path)!r} ({e})") from None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            problem = Problem(str(row["prompt"]), str(row["answer"]), str(row.get("decoy", "")))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise InputError(f"task.path: line {i + 1} of {path}: {e}") from None
        split = row.get("split")
        if split not in (None, "train", "eval"):
            raise InputError(f"task.path: line {i + 1}: split must be train or eval")
        is_eval = split == "eval" if split else i % 10 == 9
        (held if is_eval else train).append(problem)
    if not train or not held:
        raise InputError(f"task.path: {path} needs both train and eval problems")
    return train, held


TASKS = ("addition", "largest", "reverse", "jsonl")


def build_task(name: str, reward: str, path: str = "", max_a: int = 99, max_b: int = 9) -> Task:
    check_task(name, reward, path)
    verifier = resolve_reward(reward)
    if ":" in name:
        train, held = _plugin_problems(name, path, max_a, max_b)
    elif name == "addition":
        train, held = addition(max_a, max_b)
    elif name == "largest":
        train, held = largest(max_a)
    elif name == "reverse":
        train, held = reverse(max_a)
    else:
        train, held = jsonl(path)
    random.Random(0).shuffle(held)  # any prefix (task.eval_size) is a fair sample
    return Task(name, train, held, verifier)


def check_task(name: str, reward: str, path: str = "") -> None:
    """Config-time check: built-in names exist, function paths import to callables, the JSONL
    file exists, and a path is not given to a task that reads none (the task function itself
    runs only in :func:`build_task`: it may read data)."""
    resolve_reward(reward)
    if ":" in name:
        load_function(name, "task.name")  # a plug-in receives task.path as is
    elif name not in TASKS:
        raise InputError(f"task.name: unknown {name!r}; expected one of {list(TASKS)} or {_FORM}")
    elif name == "jsonl":
        if not path:
            raise InputError("task.path: required for task.name = 'jsonl'")
        if not Path(path).is_file():
            raise InputError(f"task.path: no such file {path!r} (relative to {Path.cwd()})")
    elif path:
        raise InputError(
            f"task.path: task.name = {name!r} reads no file; "
            "set task.name = 'jsonl' (or a plug-in) or leave task.path out"
        )


# ------------------------------------------------------------------ plug-ins

_FORM = "'module:function'"


def resolve_reward(reward: str) -> Verifier:
    """A name in :data:`REWARDS` (looked up now, so registering at runtime works) or a path."""
    if ":" in reward:
        return PluginReward(reward, load_function(reward, "task.reward"))
    if reward not in REWARDS:
        raise InputError(
            f"task.reward: unknown {reward!r}; expected one of {sorted(REWARDS)} or {_FORM}"
        )
    return REWARDS[reward]


def load_function(spec: str, field: str) -> Callable:
    """``"module:function"`` -> the callable; an :class:`InputError` naming ``field`` if not."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InputError(f"{field}: {spec!r} is not of the form {_FORM}")
    try:
        module = _import(module_name)
    except Exception as e:  # a missing module, or one that fails while importing
        raise InputError(f"{field}: cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    function = getattr(module, attr, None)
    if function is None:
        raise InputError(f"{field}: module {module_name!r} has no attribute {attr!r}")
    if not callable(function):
        raise InputError(f"{field}: {spec!r} is not callable (a {type(function).__name__})")
    return function


def _import(module_name: str) -> object:
    """Import from ``sys.path``, then the working directory: the ``furlong`` console script
    does not put it on ``sys.path`` the way ``python -m`` does."""
    importlib.invalidate_caches()  # the file may have been written moments ago
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    finally:
        if added:
            sys.path.remove(cwd)


@dataclass(frozen=True)
class PluginReward:
    """A user's verifier; a result that is not a finite number fails loudly and names the
    problem, rather than poisoning the advantages with NaN or a None."""

    spec: str
    function: Callable[[str, Problem], object]  # checked: a finite number

    def __call__(self, response: str, problem: Problem) -> float:
        value = self.function(response, problem)
        if isinstance(value, numbers.Real) and math.isfinite(value):
            return float(value)
        raise InputError(
            f"task.reward: {self.spec} returned {value!r} for prompt {problem.prompt!r}; "
            "expected a finite float"
        )


def _plugin_problems(
    spec: str, path: str, max_a: int, max_b: int
) -> tuple[list[Problem], list[Problem]]:
    made = load_function(spec, "task.name")(path=path, max_a=max_a, max_b=max_b)
    if not _is_split(made):
        raise InputError(
            f"task.name: {spec} must return (train, eval): two non-empty lists of Problem, "
            f"got {type(made).__name__}"
        )
    train, held = made
    return list(train), list(held)  # copies: build_task shuffles the held-out list


def _is_split(made: object) -> bool:
    return (
        isinstance(made, tuple | list)
        and len(made) == 2
        and all(isinstance(s, list) and s and all(isinstance(p, Problem) for p in s) for s in made)
    )
