"""Tasks and rewards: a task is a problem set (train / held-out split) plus a verifier.

Built-in: ``addition``, ``largest`` and ``reverse`` (synthetic and verifiable; a stable fifth
held out by hash) and ``jsonl`` (``{"prompt": ..., "answer": ...}`` per line, an optional
``"split": "train" | "eval"``; without it every tenth line is held out; an optional ``"decoy"``,
a plausible wrong answer for ``warmup.decoy_share``).
Rewards are looked up by name in :data:`REWARDS`.

Task sources from libraries (``furlong.rl.task_sources``): ``reasoning_gym:<dataset>`` and
``datasets:<file or name>``; see docs/tasks.md.

Plug-ins, slime-style: a ``task.name`` or ``task.reward`` holding a ``:`` is a function path
``"module:function"``. The module is imported with :func:`importlib.import_module` (a dotted
name on ``sys.path``; the working directory is searched last, so a ``my_reward.py`` beside the
run works under the ``furlong`` script too):

- reward: ``score(response: str, problem: Problem) -> float``, like :data:`REWARDS`' entries;
- task: ``problems(**kwargs) -> (train, eval)``, two non-empty lists of :class:`Problem`, like
  the built-in generators (``addition``, ``jsonl``). It receives the ``task.args`` table, and
  those of ``path``, ``max_a`` and ``max_b`` its signature names (all three if it takes
  ``**kwargs``).

A :class:`Problem` carries a ``metadata`` mapping (a generator's entry, a dataset's row) through
to its verifier.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import math
import numbers
import os
import random
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from furlong.errors import InputError
from furlong.rl import extract as extract_mod


@dataclass(frozen=True)
class Problem:
    prompt: str  # the user's message (rendered with the chat template by the loop)
    answer: str  # what the verifier compares against
    # a plausible wrong answer (reverse: the digits echoed), which a noisy warm-up teacher
    # shows instead of the answer (warmup.decoy_share); "" where the task has none
    decoy: str = ""
    # what the source knows about the problem (reasoning-gym's entry, a dataset's row), for
    # the verifier: problem.metadata["..."]
    metadata: Mapping[str, Any] = field(default_factory=dict, hash=False)


Verifier = Callable[[str, Problem], float]
Extractor = Callable[[str], "str | None"]  # the reply -> its answer (None: none found)
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


def numeric(response: str, problem: Problem) -> float:
    """1 when the response and the answer are the same number (commas dropped, 1e-9 relative)."""
    try:
        got, want = (float(s.strip().replace(",", "")) for s in (response, problem.answer))
    except ValueError:
        return 0.0
    return float(math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12))


def math_verify(response: str, problem: Problem) -> float:
    """1 when ``math-verify`` finds the response mathematically equal to the answer
    (``pip install 'furlong[tasks]'``): 1/2 = 0.5 = \\frac{1}{2}, sets, intervals, LaTeX."""
    from furlong.extras import require

    require("tasks", "task.reward = 'math_verify'", ("math_verify",))
    from furlong.rl.math_equivalence import equivalent

    return float(equivalent(response, problem.answer))


REWARDS: dict[str, Verifier] = {
    "exact_number": exact_number,
    "exact_match": exact_match,
    "contains": contains,
    "numeric": numeric,
    "math_verify": math_verify,
}


@dataclass(frozen=True)
class Score:
    """One reply, scored: ``correct`` is the verifier's value (what evaluations report),
    ``reward`` adds the format term (what RL learns from)."""

    reward: float
    correct: float
    answer: str | None  # what the extraction found in the reply (None: nothing)
    stopped: bool  # the reply ended with its end token (not cut at max_tokens)


@dataclass(frozen=True)
class Task:
    name: str
    train: list[Problem]
    eval: list[Problem]
    reward: Verifier  # sees the extracted answer (the whole reply by default)
    extract: Extractor = extract_mod.whole
    format_reward: float = 0.0  # added when a reply stops and has an answer
    system: str = ""  # the system message each prompt is rendered with ("": the template's)

    def sample(self, n: int, rng: random.Random) -> list[Problem]:
        return [rng.choice(self.train) for _ in range(n)]

    def score(self, reply: str, problem: Problem, stopped: bool = True) -> Score:
        answer = self.extract(reply)
        correct = 0.0 if answer is None else self.reward(answer, problem)
        formed = self.format_reward if stopped and answer is not None else 0.0
        return Score(correct + formed, correct, answer, stopped)


def stably_held_out(key: str, share: float) -> bool:
    """A stable split: the same problem is always on the same side (a hash of ``key``)."""
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
            (held if stably_held_out(f"{a}+{b}", held_out) else train).append(problem)
    return train, held


def largest(count: int = 4, held_out: float = 0.2) -> tuple[list[Problem], list[Problem]]:
    """``Which digit is largest: 3 8 1 5?`` over every string of ``count`` digits."""
    train: list[Problem] = []
    held: list[Problem] = []
    for n in range(10**count):
        digits = f"{n:0{count}d}"
        prompt = f"Which digit is largest: {' '.join(digits)}?"
        problem = Problem(prompt, max(digits), decoy=min(digits))
        (held if stably_held_out(digits, held_out) else train).append(problem)
    return train, held


def reverse(count: int = 3, held_out: float = 0.2) -> tuple[list[Problem], list[Problem]]:
    """``Reverse 3 8 1`` -> ``183`` over every string of ``count`` digits."""
    train: list[Problem] = []
    held: list[Problem] = []
    for n in range(10**count):
        digits = f"{n:0{count}d}"
        problem = Problem(f"Reverse {' '.join(digits)}", digits[::-1], decoy=digits)
        (held if stably_held_out(digits, held_out) else train).append(problem)
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


def build_task(
    name: str,
    reward: str,
    path: str = "",
    max_a: int = 99,
    max_b: int = 9,
    args: Mapping[str, Any] | None = None,
) -> Task:
    """A built-in, JSONL or plug-in task (``args``: a plug-in's ``task.args``)."""
    check_task(name, reward, path)
    verifier = resolve_reward(reward)
    if ":" in name:
        train, held = _plugin_problems(name, dict(args or {}), path, max_a, max_b)
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
    """A name in :data:`REWARDS` (looked up now, so registering at runtime works) or a path;
    ``auto`` here is ``exact_number``."""
    if reward == "auto":
        reward = "exact_number"
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
    spec: str, args: dict[str, Any], path: str, max_a: int, max_b: int
) -> tuple[list[Problem], list[Problem]]:
    function = load_function(spec, "task.name")
    kwargs = _accepted(function, {"path": path, "max_a": max_a, "max_b": max_b}) | args
    try:
        inspect.signature(function).bind(**kwargs)
    except TypeError as e:  # a task.args key it does not take, or one it needs and lacks
        raise InputError(f"task.args: {spec} cannot take {sorted(kwargs)}: {e}") from None
    made = function(**kwargs)
    if not _is_split(made):
        raise InputError(
            f"task.name: {spec} must return (train, eval): two non-empty lists of Problem, "
            f"got {type(made).__name__}"
        )
    train, held = made
    return list(train), list(held)  # copies: build_task shuffles the held-out list


def _accepted(function: Callable, offered: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``offered`` that ``function``'s signature names (all with ``**kwargs``)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without a signature: offer everything
        return offered
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return offered
    return {k: v for k, v in offered.items() if k in parameters}


def _is_split(made: object) -> bool:
    return (
        isinstance(made, tuple | list)
        and len(made) == 2
        and all(isinstance(s, list) and s and all(isinstance(p, Problem) for p in s) for s in made)
    )
