"""A black-box calculator agent: it knows nothing about furlong, only an OpenAI-compatible base
URL. It asks the model, runs the calculator for every tool call, sends the result back, and
stops at the first answer without a tool call (or after ``max_turns``)."""

from __future__ import annotations

import ast
import json
import operator
from dataclasses import dataclass

import httpx

SYSTEM = "Use calc for arithmetic."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
        },
    }
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expr: str) -> str:
    """Integer + - * only; anything else is an error message for the model to read."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("unsupported")

    try:
        return str(value(ast.parse(expr, mode="eval").body))
    except (SyntaxError, ValueError, RecursionError):
        return "error"


@dataclass(frozen=True)
class Outcome:
    answer: str  # the final message's content
    tool_calls: int  # calculator calls made on the way


def solve(
    client: httpx.Client,
    base_url: str,
    question: str,
    seed: int,
    max_turns: int = 3,
    max_tokens: int = 64,
) -> Outcome:
    """Answer ``question``; every model call goes to ``base_url``."""
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    calls = 0
    for turn in range(max_turns):
        request = {
            "messages": messages,
            "tools": TOOLS,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": seed * 16 + turn,
        }
        while True:
            response = client.post(f"{base_url}/chat/completions", json=request)
            if response.status_code != 503:  # 503: aborted by a weight update, just retry
                break
        response.raise_for_status()
        message = response.json()["choices"][0]["message"]
        messages.append(message)
        if not message.get("tool_calls"):
            return Outcome(message["content"] or "", calls)
        for call in message["tool_calls"]:
            calls += 1
            arguments = json.loads(call["function"]["arguments"])
            expr = arguments.get("expr", "") if isinstance(arguments, dict) else ""
            result = calculator(str(expr))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return Outcome("", calls)
