"""The OpenAI chat-completions wire: request validation and the response body.

Requests are validated whole before a session is touched; every error names its field
(``messages[2].tool_calls[0].function.arguments``). Supported: ``messages`` (system, user,
assistant with ``tool_calls``, tool), ``tools`` (functions), ``tool_choice`` ``auto`` | ``none``,
``temperature``, ``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``seed``, ``stop``,
``logprobs`` / ``top_logprobs``. Features that would change sampling but are not implemented
(``n`` > 1, streaming, penalties, ``logit_bias``) are rejected rather than ignored.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

from furlong.errors import InputError
from furlong.rollout.sampling import check_seed

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Message:
    role: str
    content: str  # "" for a null content
    tool_calls: tuple[ToolCall, ...] = ()

    def key(self) -> tuple:
        """What identifies an assistant message the session returned (ids and argument
        whitespace may differ in the echo)."""
        calls = tuple((c.name, _canonical(c.arguments)) for c in self.tool_calls)
        return (self.role, self.content, calls)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role}
        out["content"] = self.content if self.content or not self.tool_calls else None
        if self.tool_calls:
            out["tool_calls"] = [c.to_json() for c in self.tool_calls]
        return out


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...]  # {"type": "function", "function": {...}}
    parse_tool_calls: bool  # tool_choice != "none"
    max_tokens: int | None  # None: as many as the context leaves (up to the server's limit)
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    logprobs: bool
    top_logprobs: int


def _canonical(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except (ValueError, RecursionError):
        return arguments


def _content(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: text only
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InputError(f"{where}[{j}]: only text content parts are supported")
            if not isinstance(part.get("text"), str):
                raise InputError(f"{where}[{j}].text: expected a string")
            texts.append(part["text"])
        return "".join(texts)
    raise InputError(f"{where}: expected a string, a list of text parts or null")


def _tool_call(value: Any, where: str) -> ToolCall:
    if not isinstance(value, dict):
        raise InputError(f"{where}: expected an object")
    if value.get("type", "function") != "function":
        raise InputError(f"{where}.type: only 'function' tool calls are supported")
    fn = value.get("function")
    if not isinstance(fn, dict):
        raise InputError(f"{where}.function: expected an object")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InputError(f"{where}.function.name: expected a non-empty string")
    arguments = fn.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise InputError(f"{where}.function.arguments: expected a JSON string")
    try:
        json.loads(arguments)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise InputError(f"{where}.function.arguments: not valid JSON ({exc!r})") from None
    return ToolCall(str(value.get("id", "")), fn["name"], arguments)


def parse_message(value: Any, i: int) -> Message:
    where = f"messages[{i}]"
    if not isinstance(value, dict):
        raise InputError(f"{where}: expected an object")
    role = value.get("role")
    if role not in ROLES:
        raise InputError(f"{where}.role: {role!r} is not one of {list(ROLES)}")
    if "content" not in value and not (role == "assistant" and value.get("tool_calls")):
        raise InputError(f"{where}.content: missing")
    content = _content(value.get("content"), f"{where}.content")
    calls = value.get("tool_calls") or []
    if calls and role != "assistant":
        raise InputError(f"{where}.tool_calls: only assistant messages carry tool calls")
    if not isinstance(calls, list):
        raise InputError(f"{where}.tool_calls: expected a list")
    parsed = tuple(_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls))
    return Message(role, content, parsed)


def _tool(value: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(value, dict) or value.get("type") != "function":
        raise InputError(f"{where}: expected {{'type': 'function', 'function': {{...}}}}")
    fn = value.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InputError(f"{where}.function.name: expected a non-empty string")
    return {"type": "function", "function": fn}


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InputError(f"{name}: expected a number, got {value!r}")
    if not low <= value <= high:
        raise InputError(f"{name}: must be in [{low}, {high}], got {value}")
    return float(value)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise InputError(f"{name}: expected an integer, got {value!r}")
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InputError(f"{name}: expected a bool, got {value!r}")
    return bool(value)


def _top_p(body: dict) -> float:
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise InputError("top_p: must be in (0, 1], got 0")
    return top_p


def parse_chat_request(body: dict[str, Any], max_tokens_limit: int) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InputError("messages: expected a non-empty list of messages")
    parsed = tuple(parse_message(m, i) for i, m in enumerate(messages))
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise InputError("tools: expected a list")
    choice = body.get("tool_choice", "auto")
    if choice not in (None, "auto", "none"):
        raise InputError(f"tool_choice: only 'auto' and 'none' are supported, got {choice!r}")
    if _integer(body, "n") not in (None, 1):
        raise InputError(f"n: only 1 completion per request is supported, got {body['n']}")
    if _flag(body, "stream"):
        raise InputError("stream: streaming is not supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise InputError(f"{name}: penalties are not supported (they change sampling)")
    if body.get("logit_bias"):
        raise InputError("logit_bias: not supported (it changes sampling)")
    max_tokens = _integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens")
    if max_tokens is not None and not 1 <= max_tokens <= max_tokens_limit:
        raise InputError(f"max_tokens: must be in [1, {max_tokens_limit}], got {max_tokens}")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InputError("stop: expected a non-empty string or a list of them")
    top_logprobs = _integer(body, "top_logprobs") or 0
    if not 0 <= top_logprobs <= 20:
        raise InputError(f"top_logprobs: must be in [0, 20], got {top_logprobs}")
    return ChatRequest(
        messages=parsed,
        tools=tuple(_tool(t, i) for i, t in enumerate(tools)),
        parse_tool_calls=choice != "none",
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_top_p(body),
        seed=None if body.get("seed") is None else check_seed(body["seed"]),
        stop=tuple(stop),
        logprobs=_flag(body, "logprobs"),
        top_logprobs=top_logprobs,
    )


def completion_body(
    completion_id: str,
    model: str,
    message: dict[str, Any],
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
