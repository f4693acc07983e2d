"""``task.reward = "math_verify"``: mathematical equality by HF's ``math-verify`` (an extra:
``pip install 'furlong[tasks]'``): 1/2 = 0.5 = \\frac{1}{2}, sets, intervals, LaTeX."""

from __future__ import annotations

from math_verify import parse, verify


def equivalent(response: str, reference: str) -> bool:
    def as_math(text: str) -> list:
        return parse(text if "$" in text or "\\" in text else f"${text}$")

    return bool(verify(as_math(reference), as_math(response)))
