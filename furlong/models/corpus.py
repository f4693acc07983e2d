"""Deterministic synthetic text the offline tokenizer is trained on.

It covers what the built-in tasks and demos say: arithmetic, short English sentences, chat
turns, code-ish lines and some non-ASCII, so common strings become single tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

WORDS = (
    "the a an of to and in is it that for on with as was by at be this from or have not are "
    "what which who when where why how answer question number sum total add plus minus times "
    "equals result first second third last next value list word letter count reverse sort "
    "copy repeat say write read think step because so then therefore yes no true false "
    "model train reward policy sample token loss learn correct wrong good great small large "
    "red green blue cat dog bird tree river mountain city house book water fire light dark"
).split()
UNICODE = "café naïve über straße 東京 数学 привет ελληνικά emoji 🙂 ✓ → ≤ ≥ π".split()
ROLES = ("system", "user", "assistant", "tool")


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
    if rng.random() < 0.1:
        words.append(rng.choice(UNICODE))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".?!")


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op, value = rng.choice((("+", a + b), ("-", a - b), ("*", a * b)))
    form = rng.randrange(3)
    if form == 0:
        return f"{a} {op} {b} = {value}"
    if form == 1:
        return f"What is {a} {op} {b}? The answer is {value}."
    return f"Compute {a}{op}{b}. Answer: {value}"


def _code(rng: random.Random) -> str:
    name = rng.choice(WORDS)
    return f"def {name}(x, y):\n    return x {rng.choice('+-*')} y  # {rng.choice(WORDS)}"


def _chat(rng: random.Random) -> str:
    turns = []
    for _ in range(rng.randint(1, 3)):
        role = rng.choice(ROLES)
        turns.append(f"<|im_start|>{role}\n{_sentence(rng)}<|im_end|>\n")
    return "".join(turns)


def synthetic_corpus(lines: int = 40_000, seed: int = 0) -> Iterator[str]:
    rng = random.Random(seed)
    makers = (_sentence, _arithmetic, _arithmetic, _code, _chat)
    for _ in range(lines):
        yield rng.choice(makers)(rng)
