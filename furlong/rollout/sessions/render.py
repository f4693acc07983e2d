"""Messages -> prompt token ids in ChatML, and tool calls <-> assistant text.

The offline tokenizer's chat template is ChatML over ``role`` and ``content`` only, with no
tool support, so the session server renders ChatML itself (identical to the template for plain
messages, which a test checks) and adds tools the way Qwen/Hermes-style templates do:

- ``tools`` go into the system message, one JSON object per line inside ``<tools>...</tools>``;
- an assistant tool call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- a tool result is its own ``tool`` turn: ``<|im_start|>tool\\n{content}<|im_end|>``.

Token-in/token-out: an assistant message the session itself returned is not re-tokenized from
its text; its exact sampled token ids are spliced in, so the prompt extends the session's
checkpoint token for token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from furlong.errors import InputError
from furlong.rollout.sessions.chat import Message, ToolCall

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
GENERATION_PROMPT = f"{IM_START}assistant\n"
TOOLS_HEADER = (
    '# Tools\nTo call a tool, reply <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
)
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

# the sampled ids of an assistant message the session returned, or None
AssistantTokens = Callable[[Message], list[int] | None]


@dataclass(frozen=True)
class PromptBudget:
    """A turn's prompt must leave room in the model's context for at least one new token.
    No token covers more than ``chars_per_token`` characters (the longest vocabulary entry:
    byte-level entries are one character per byte), so longer text is refused before it is
    tokenized, and a prompt is refused before the engine allocates for it."""

    context: int  # the model's max_position_embeddings
    chars_per_token: int

    @classmethod
    def of(cls, tokenizer: Any, context: int) -> PromptBudget:
        return cls(context, max(map(len, tokenizer.get_vocab())))

    @property
    def tokens(self) -> int:
        return self.context - 1

    def check_text(self, used: int, text: str, field: str) -> None:
        if len(text) > (self.tokens - used) * self.chars_per_token:
            raise InputError(
                f"{field}: {len(text)} characters cannot fit the model's context of "
                f"{self.context} tokens ({used} already used by the prompt)"
            )

    def check_tokens(self, used: int, field: str) -> None:
        if used > self.tokens:
            raise InputError(
                f"{field}: the prompt reaches {used} tokens here; the model's context of "
                f"{self.context} tokens must also hold max_tokens (at least 1)"
            )


def check_chatml(tokenizer: Any) -> None:
    vocab = tokenizer.get_vocab()
    missing = [t for t in (IM_START, IM_END) if t not in vocab]
    if missing:
        raise InputError(f"tokenizer: the session server renders ChatML; {missing} not in vocab")


def format_tool_call(call: ToolCall) -> str:
    payload = {"name": call.name, "arguments": json.loads(call.arguments)}
    return f"<tool_call>\n{json.dumps(payload)}\n</tool_call>"


def tools_text(tools: Sequence[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(t["function"]) for t in tools)
    return f"{TOOLS_HEADER}\n<tools>\n{lines}\n</tools>"


def message_text(message: Message) -> str:
    body = message.content
    if message.tool_calls:
        calls = "\n".join(format_tool_call(c) for c in message.tool_calls)
        body = f"{body}\n{calls}" if body else calls
    return f"{IM_START}{message.role}\n{body}{IM_END}\n"


def with_tools(messages: Sequence[Message], tools: Sequence[dict[str, Any]]) -> list[Message]:
    """The tool list joins the first system message (or opens one)."""
    if not tools:
        return list(messages)
    text = tools_text(tools)
    if messages and messages[0].role == "system":
        first = messages[0]
        content = f"{first.content}\n\n{text}" if first.content else text
        return [Message("system", content), *messages[1:]]
    return [Message("system", text), *messages]


def render_prompt(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: Sequence[dict[str, Any]],
    assistant_tokens: AssistantTokens,
    budget: PromptBudget | None = None,
) -> list[int]:
    """Prompt ids ending with the assistant's generation prompt. With a ``budget``, a prompt
    that cannot fit is an :class:`InputError` naming the message where it overflows."""

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    tail = encode(GENERATION_PROMPT)
    rendered = with_tools(messages, tools)
    opened = len(rendered) - len(messages)  # 1 when the tools opened a system message
    ids: list[int] = []
    for i, message in enumerate(rendered):
        field = _field(i - opened, message, bool(tools))
        sampled = assistant_tokens(message) if message.role == "assistant" else None
        if sampled is None:
            text = message_text(message)
            if budget is not None:
                budget.check_text(len(ids) + len(tail), text, field)
            ids += encode(text)
        else:
            # exactly what was sampled; a turn cut by length or a stop string gets its end
            closing = [] if sampled and sampled[-1] == im_end else [im_end]
            ids += encode(f"{IM_START}assistant\n") + sampled + closing + encode("\n")
        if budget is not None:
            budget.check_tokens(len(ids) + len(tail), field)
    return ids + tail


def _field(index: int, message: Message, tools: bool) -> str:
    """The request field a rendered message comes from (for errors)."""
    if index < 0:
        return "tools"
    if index == 0 and tools and message.role == "system":
        return "messages[0].content / tools"
    return f"messages[{index}]" if message.tool_calls else f"messages[{index}].content"


def parse_tool_calls(text: str, call_id: Callable[[int], str]) -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` from an assistant's text. Only well-formed blocks (a JSON object
    with a string ``name``) count; with any malformed block the text stays plain content."""
    calls = []
    for i, match in enumerate(_TOOL_CALL.finditer(text)):
        try:
            payload = json.loads(match.group(1))
        except ValueError:
            return text, []
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return text, []
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # already JSON text: it must parse
            try:
                json.loads(arguments)
            except ValueError:
                return text, []
        else:
            arguments = json.dumps(arguments)
        calls.append(ToolCall(call_id(i), payload["name"], arguments))
    if not calls:
        return text, []
    return _TOOL_CALL.sub("", text).strip(), calls
