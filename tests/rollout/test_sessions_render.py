"""Rendering a session's messages: ChatML identical to the tokenizer's template for plain
messages, tools in the system turn, tool results as ``tool`` turns, tool calls both ways, and
the session's own sampled ids spliced in for its assistant messages."""

from __future__ import annotations

import json

import pytest

from furlong.errors import InputError
from furlong.models.tokenizer import train_tokenizer
from furlong.rollout.sessions.chat import Message, ToolCall, parse_chat_request
from furlong.rollout.sessions.render import (
    check_chatml,
    format_tool_call,
    parse_tool_calls,
    render_prompt,
)

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def none(_message: Message) -> None:
    return None


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_plain_messages_render_exactly_like_the_chat_template(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": " 42 "},
        {"role": "user", "content": "Thanks!\nBye"},
    ]
    ours = render_prompt(tokenizer, [Message(m["role"], m["content"]) for m in messages], [], none)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == tokenizer.encode(text, add_special_tokens=False)


def test_tools_join_the_system_turn_and_tool_results_are_tool_turns(tokenizer) -> None:
    call = ToolCall("call_1", "calc", '{"expr": "2+3"}')
    messages = [
        Message("user", "What is 2 + 3?"),
        Message("assistant", "", (call,)),
        Message("tool", "5"),
    ]
    text = decode(tokenizer, render_prompt(tokenizer, messages, TOOLS, none))
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(TOOLS[0]["function"]) in text
    assert '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>' in text
    assert text.endswith("<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")
    with_system = [Message("system", "Be brief."), *messages]
    text = decode(tokenizer, render_prompt(tokenizer, with_system, TOOLS, none))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1


def test_tool_calls_parse_back_and_malformed_blocks_stay_text() -> None:
    call = ToolCall("x", "calc", '{"expr": "7*6"}')
    content, calls = parse_tool_calls(f"Let me compute.\n{format_tool_call(call)}", str)
    assert content == "Let me compute."
    assert [(c.id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("0", "calc", {"expr": "7*6"})
    ]
    for text in [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "calc", "arguments": "{oops"}</tool_call>',
        "no call at all",
    ]:
        assert parse_tool_calls(text, str) == (text, [])


def test_returned_assistant_messages_splice_their_sampled_ids(tokenizer) -> None:
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    returned = Message("assistant", "whatever the text was")
    messages = [Message("user", "hi"), returned, Message("user", "again")]
    # the first turn's prompt ends with "<|im_start|>assistant\n": the sampled ids follow it
    head = render_prompt(tokenizer, messages[:1], [], none)
    # ids whose text would not re-tokenize to themselves; stopped (ends with <|im_end|>) or
    # cut by length (the end marker is added)
    for sampled, closing in [([400, 401, im_end], []), ([400, 401], [im_end])]:

        def lookup(message: Message, sampled=sampled) -> list[int] | None:
            return sampled if message.key() == returned.key() else None

        ids = render_prompt(tokenizer, messages, [], lookup)
        spliced = head + sampled + closing
        assert ids[: len(spliced)] == spliced
        assert decode(tokenizer, ids[len(spliced) :]).startswith("\n<|im_start|>user\nagain")


def test_a_tokenizer_without_chatml_is_rejected() -> None:
    class Plain:
        def get_vocab(self) -> dict[str, int]:
            return {"a": 0}

    with pytest.raises(InputError, match="renders ChatML"):
        check_chatml(Plain())


@pytest.mark.parametrize(
    "body,field",
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\]\.role"),
        ({"messages": [{"role": "user"}]}, r"messages\[0\]\.content: missing"),
        ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\]\.content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            r"messages\[0\]\.content\[0\]",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "calc", "arguments": "{x"}}],
                    },
                ]
            },
            r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: not valid JSON",
        ),
        ({"tools": [{"type": "retrieval"}]}, r"tools\[0\]"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"n": 2}, "n: only 1"),
        ({"stream": True}, "stream"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"seed": "7"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
    ],
)
def test_bad_chat_requests_name_the_field(body: dict, field: str) -> None:
    full = {"messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(InputError, match=field):
        parse_chat_request(full, max_tokens_limit=4096)
