"""Hostile input to `furlong session-server` over real HTTP on 127.0.0.1: wrong types, seeds
outside 64 bits, prompts longer than the model's context (refused before anything is
allocated for them) and bad weight paths get a 4xx naming the field (never a 5xx); nothing
reaches the engine, and afterwards a normal turn gives the same output as before."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from furlong.rollout.sessions import SessionServer

from .session_helpers import chat, info, open_session, serve, turn

pytestmark = pytest.mark.usefixtures("one_thread")
USER = [{"role": "user", "content": "What is 2 + 3?"}]
CONTEXT = 2048  # the tiny presets' max_position_embeddings


@pytest.fixture(scope="module")
def served(one_thread):
    with serve() as (server, spy, client):
        sid = open_session(client)
        expected = turn(client, sid, USER, seed=4)
        yield server, spy, client, expected


def assert_unchanged(server: SessionServer, client: httpx.Client, expected: dict) -> None:
    assert server.engine.weight_version == 0 and not server.engine.paused
    assert turn(client, open_session(client), USER, seed=4) == expected


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def call(arguments: str) -> dict:
    function = {"name": "f", "arguments": arguments}
    return {"role": "assistant", "content": None, "tool_calls": [{"function": function}]}


SEEDS = [2**64, 10**30, -1, 1.5, "7", True, [0]]
BAD_BODIES = [
    *[({"seed": s}, "seed") for s in SEEDS],
    *[
        ({field: value}, field)
        for field in ("temperature", "top_p")
        for value in ("hot", [], {}, True, math.nan, math.inf)
    ],
    *[
        ({field: value}, field)
        for field in ("max_tokens", "max_completion_tokens", "top_logprobs", "n")
        for value in ("8", 1.5, True, [8])
    ],
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": CONTEXT}, "max_tokens"),  # with the prompt, over the context
    ({"max_completion_tokens": CONTEXT - 5}, "max_tokens"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"stream": "no"}, "stream"),
    ({"presence_penalty": "x"}, "presence_penalty"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"tools": "calc"}, "tools"),
    ({"tools": [5]}, "tools[0]"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [5]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0]"),
    ({"messages": [user("x" * 200_000)]}, "messages[0].content"),  # once a ~40 GB prefill
    ({"messages": [*USER, user("é" * 5_000)]}, "messages[1].content"),
    ({"messages": [user("two words " * 120)] * 4}, "messages[3].content"),
    ({"messages": [*USER, call("[" * 100_000)]}, "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [*USER, call(json.dumps({"x": "y" * 50_000}))]}, "messages[1]"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "description": "d" * 50_000}}]},
        "tools",
    ),
]


@pytest.mark.parametrize(("body", "field"), BAD_BODIES, ids=[f for _, f in BAD_BODIES])
def test_bad_chat_bodies_get_400_naming_the_field(served, body: dict, field: str) -> None:
    server, spy, client, expected = served
    sid = open_session(client)
    before, submitted = info(client, sid), len(spy.params)
    full = {"messages": USER, "max_tokens": 8, "seed": 0, **body}
    url = f"/sessions/{sid}/v1/chat/completions"
    response = client.post(url, content=json.dumps(full))  # json: NaN allowed
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]
    assert len(spy.params) == submitted and info(client, sid) == before  # nothing ran
    assert_unchanged(server, client, expected)


def test_max_tokens_defaults_to_what_fits_the_context(served) -> None:
    server, spy, client, _ = served
    sid = open_session(client)
    response = chat(client, sid, USER, max_tokens=None, seed=1)
    assert response.status_code == 200, response.text
    assert len(spy.prompts[-1]) + spy.params[-1].max_tokens == CONTEXT


def test_json_nested_too_deeply_is_400(served) -> None:
    server, _, client, expected = served
    url = f"/sessions/{open_session(client)}/v1/chat/completions"
    response = client.post(url, content=b"[" * 100_000)
    assert response.status_code == 400 and "body" in response.json()["error"]["message"]
    assert_unchanged(server, client, expected)


def test_a_body_over_the_limit_is_413(served) -> None:
    from furlong.rollout.sessions import create_app
    from furlong.serving import background_server

    server, _, _, expected = served
    with (
        background_server(create_app(server, max_body_bytes=4096)) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        sid = open_session(client)
        response = chat(client, sid, [user("x" * 5000)])
        assert response.status_code == 413 and "Too Large" in response.text
        response = client.post(
            f"/sessions/{sid}/v1/chat/completions", content=(b" " * 1024 for _ in range(8))
        )
        assert response.status_code == 413 and "body" in response.json()["error"]["message"]
        assert_unchanged(server, client, expected)


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("MISSING", "path:"),
        ("EMPTY_DIR", "path:"),
        ("TEXT_FILE", "path:"),
        (5, "path:"),
        (["a"], "path:"),
        ("", "path:"),
        (None, "path:"),
    ],
)
def test_bad_weight_paths_are_400_and_change_nothing(served, tmp_path, path, field) -> None:
    server, spy, client, expected = served
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("not safetensors")
    where = {
        "MISSING": str(tmp_path / "missing"),
        "EMPTY_DIR": str(tmp_path / "empty"),
        "TEXT_FILE": str(tmp_path / "notes.txt"),
    }
    sid = open_session(client)
    first = turn(client, sid, USER, seed=2)
    before = info(client, sid)
    response = client.post(
        "/weights",
        json={"path": where.get(path, path) if isinstance(path, str) else path, "version": 5},
    )
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]
    assert info(client, sid) == before
    turn(client, sid, [*USER, first, user("again")], seed=3)  # the session goes on
    assert [r.weight_version for r in server.get(sid).records] == [0, 0]
    assert_unchanged(server, client, expected)
