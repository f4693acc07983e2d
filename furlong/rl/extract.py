"""Where a reply's answer is: the step between a model's words and a task's verifier.

A verifier compares an answer with the reference (``task.reward``); ``task.extract`` says what
part of the reply is the answer. ``None`` means the reply holds none: it scores 0 and earns no
format reward. The reasoning-gym convention is ``<answer>...</answer>`` (its system prompts ask
for it); a model too small to follow that convention answers in words, and ``last_number``
takes the number it ends on ("The answer is 15." -> "15").
"""

from __future__ import annotations

import re
from collections.abc import Callable

from furlong.errors import InputError, did_you_mean

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)  # reasoning_gym.utils' pattern


def whole(reply: str) -> str:
    return reply


def first_number(reply: str) -> str | None:
    found = _NUMBER.search(reply)
    return found.group() if found else None


def last_number(reply: str) -> str | None:
    found = _NUMBER.findall(reply)
    return found[-1] if found else None


def answer_tag(reply: str) -> str | None:
    """The last ``<answer>...</answer>`` span, stripped (as reasoning-gym's ``extract_answer``)."""
    found = _TAG.findall(reply)
    return found[-1].strip() if found else None


def boxed(reply: str) -> str | None:
    """The last ``\\boxed{...}``, braces balanced (the math datasets' convention)."""
    start = reply.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(reply)):
        depth += {"{": 1, "}": -1}.get(reply[j], 0)
        if depth == 0:
            return reply[i + 1 : j].strip()
    return None  # unbalanced: cut before its closing brace


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "whole": whole,
    "first_number": first_number,
    "last_number": last_number,
    "answer_tag": answer_tag,
    "boxed": boxed,
}


def resolve_extract(name: str) -> Callable[[str], str | None]:
    """``task.extract``'s function (``auto`` resolved to the source's choice first)."""
    if name not in EXTRACTORS:
        choices = [*EXTRACTORS, "auto"]
        raise InputError(
            f"task.extract: unknown {name!r}; expected one of {choices}"
            + did_you_mean(name, choices)
        )
    return EXTRACTORS[name]


def wrap(answer: str, name: str) -> str:
    """A reply that ``name`` extracts ``answer`` from (the constant-answer check's replies)."""
    if name == "answer_tag":
        return f"<answer>{answer}</answer>"
    if name == "boxed":
        return f"\\boxed{{{answer}}}"
    return answer
