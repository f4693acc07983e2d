"""The session server over real HTTP: token-in/token-out trajectories, tool tokens, the OpenAI
response shape, aborted turns (503, nothing committed), pause modes, closing, bad requests."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from furlong.rollout.codec import opt_in
from furlong.rollout.sessions.wire import sample_from_json

from .session_helpers import chat, info, open_session, perturbed, serve, turn

pytestmark = pytest.mark.usefixtures("one_thread")
USER = [{"role": "user", "content": "What is 2 + 3?"}]


def wait_until_queued(engine) -> None:
    deadline = time.monotonic() + 30
    while not engine.busy:
        assert time.monotonic() < deadline, "the turn never reached the engine"
        time.sleep(0.002)


def test_token_in_token_out_trajectory() -> None:
    with serve() as (server, _, client):
        tokenizer = server.tokenizer
        sid = open_session(client)
        first = turn(client, sid, USER, seed=5, max_tokens=12)
        (record,) = server.get(sid).records
        # what makes token-in/token-out necessary: the text does not re-tokenize to the ids
        assert tokenizer.encode(first["content"], add_special_tokens=False) != [
            t for t in record.output_ids if t != tokenizer.eos_token_id
        ]
        tool = {"role": "tool", "content": "5"}
        turn(client, sid, [*USER, first, tool], seed=6, max_tokens=12)
        one, two = server.get(sid).records
        checkpoint = one.prompt_ids + one.output_ids
        assert two.prompt_ids[: len(checkpoint)] == checkpoint  # extended, not re-rendered
        sample = sample_from_json(client.post(f"/sessions/{sid}/samples").json()["samples"][0])
        assert (
            sample.tokens.tolist() == two.prompt_ids + two.output_ids == info(client, sid)["tokens"]
        )
        observation = len(two.prompt_ids) - len(checkpoint)
        mask = [1.0] * len(one.output_ids) + [0.0] * observation + [1.0] * len(two.output_ids)
        assert sample.loss_mask.tolist() == mask
        assert sample.prompt_length == len(one.prompt_ids)
        expected = one.output_logprobs + [0.0] * observation + two.output_logprobs
        assert torch.equal(sample.rollout_logprobs, torch.tensor(expected))
        assert sample.sampling_mask is None and sample.routed_experts is None


def test_tool_tokens_get_singleton_supports() -> None:
    with serve() as (server, _, client):
        sid = open_session(client, return_sampling_mask=True)
        first = turn(client, sid, USER, seed=1, top_p=0.9)
        turn(client, sid, [*USER, first, {"role": "tool", "content": "5"}], seed=2, top_p=0.9)
        url = f"/sessions/{sid}/samples?fields=sampling_mask"
        body = client.post(url, json={"reward": 0.5}).json()["samples"][0]
        sample = sample_from_json(body, opt_in("sampling_mask"))
        assert sample.reward == 0.5
        response = sample.response.tolist()
        rows = sample.sampling_mask.to_lists()
        assert len(rows) == len(response) == sample.response_length
        for token, row, loss in zip(response, rows, sample.loss_mask.tolist(), strict=True):
            if loss == 0.0:
                assert row == [token]  # environment token: a singleton support
            else:
                assert token in row and len(row) > 1  # sampled from a truncated set
        assert (sample.loss_mask == 0).any()


def scripted(tokenizer, text: str):
    """An engine edit that makes the model 'say' ``text`` (then stop)."""
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    def edit(result):
        return dataclasses.replace(
            result, output_ids=ids, output_logprobs=[-0.5] * len(ids), finish_reason="stop"
        )

    return edit


def test_openai_response_with_tool_calls_round_trips() -> None:
    from .session_helpers import model

    _, tokenizer = model("tiny-qwen3")
    say = 'Sure.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "calc"}}]
    with serve(edit=scripted(tokenizer, say)) as (server, spy, client):
        sid = open_session(client)
        response = chat(client, sid, USER, tools=tools, logprobs=True)
        body = response.json()
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        (choice,) = body["choices"]
        assert choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        assert message["content"] == "Sure."
        (call,) = message["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "calc"
        assert call["function"]["arguments"] == '{"expr": "2+3"}'
        (record,) = server.get(sid).records
        assert body["usage"] == {
            "prompt_tokens": len(record.prompt_ids),
            "completion_tokens": len(record.output_ids),
            "total_tokens": len(record.prompt_ids) + len(record.output_ids),
        }
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == record.output_logprobs
        # the agent echoes the call (argument whitespace changed) and answers with the result
        echoed = {**message, "tool_calls": [{**call, "function": {**call["function"]}}]}
        echoed["tool_calls"][0]["function"]["arguments"] = '{"expr":"2+3"}'
        result = {"role": "tool", "tool_call_id": call["id"], "content": "5"}
        turn(client, sid, [*USER, echoed, result], tools=tools)
        one, two = server.get(sid).records
        assert two.prompt_ids[: one.checkpoint_len] == one.prompt_ids + one.output_ids


def test_stop_strings_are_left_out_of_the_content() -> None:
    from .session_helpers import model

    _, tokenizer = model("tiny-qwen3")
    with serve(edit=scripted(tokenizer, "The answer is 5. END more")) as (_, _, client):
        sid = open_session(client)
        message = turn(client, sid, USER, stop=["END", "answer"])
        assert message["content"] == "The "


def test_an_aborted_turn_is_503_and_changes_nothing() -> None:
    with serve("tiny-qwen3-moe", pause_mode="abort") as (server, spy, client):
        sid = open_session(client)
        first = turn(client, sid, USER, seed=1)
        before = info(client, sid)
        messages = [*USER, first, {"role": "tool", "content": "5"}]
        spy.engine.pause("in_place")  # hold the next turn in the engine's queue
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(chat, client, sid, messages, seed=2)
            wait_until_queued(spy.engine)
            assert server.publish_weights(perturbed(spy.engine.model), 1) == 1
            response = pending.result(timeout=60)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert "aborted by the engine (a weight update" in response.json()["error"]["message"]
        after = info(client, sid)
        (aborted,) = after.pop("aborted")  # noted, never committed
        assert aborted["reason"] == "engine" and aborted["output_tokens"] == 0
        assert after == {k: v for k, v in before.items() if k != "aborted"}  # same checkpoint
        turn(client, sid, messages, seed=2)  # the agent retries: same offset, new weights
        assert [p.routed_experts_start for p in spy.params][-2:] == [len(before["tokens"]) - 1] * 2
        records = server.get(sid).records
        assert len(records) == 2 and records[1].weight_version == 1


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_in_flight_turns_survive_a_publish_in_other_modes(mode: str) -> None:
    with serve("tiny-qwen3-moe", pause_mode=mode) as (server, spy, client):
        sid = open_session(client)
        spy.engine.pause("in_place")
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(chat, client, sid, USER, seed=1)
            wait_until_queued(spy.engine)
            server.publish_weights(perturbed(spy.engine.model), 7)
            response = pending.result(timeout=60)
        assert response.status_code == 200, response.text
        (record,) = server.get(sid).records
        assert record.weight_version == 7
        assert record.start_len == (0 if mode == "in_place" else None)


def test_close_a_session_even_mid_turn() -> None:
    with serve() as (server, spy, client):
        sid = open_session(client)
        spy.engine.pause("in_place")
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(chat, client, sid, USER)
            wait_until_queued(spy.engine)
            assert client.delete(f"/sessions/{sid}").json() == {"id": sid, "deleted": True}
            response = pending.result(timeout=60)
        spy.engine.resume()
        assert response.status_code == 404 and "closed" in response.json()["error"]["message"]
        assert not spy.engine.busy  # its engine request was aborted
        for method, path in [
            ("GET", f"/sessions/{sid}"),
            ("POST", f"/sessions/{sid}/samples"),
            ("DELETE", f"/sessions/{sid}"),
        ]:
            assert client.request(method, path).status_code == 404
        assert server.sessions == {}


def test_too_many_sessions_is_429() -> None:
    with serve(max_sessions=2) as (_, _, client):
        open_session(client)
        second = open_session(client)
        assert client.post("/sessions").status_code == 429
        client.delete(f"/sessions/{second}")
        open_session(client)


def test_bad_requests_are_4xx_and_leave_other_sessions_untouched() -> None:
    with serve() as (server, spy, client):
        bystander, target = open_session(client), open_session(client)
        first = turn(client, bystander, USER, seed=1)
        before = {sid: info(client, sid) for sid in (bystander, target)}
        url = f"/sessions/{target}/v1/chat/completions"
        cases = [
            (
                client.post("/sessions/nope/v1/chat/completions", json={"messages": USER}),
                404,
                "nope",
            ),
            (client.post("/sessions/nope/samples"), 404, "nope"),
            (client.post(url, content=b"{not json"), 400, "body: not JSON"),
            (client.post(url, json=[1, 2]), 400, "expected a JSON object"),
            (client.post(url, json={"messages": [{"content": "x"}]}), 400, "messages[0].role"),
            (client.post(url, json={"messages": [*USER, {"role": "tool"}]}), 400, "messages[1]"),
            (client.post(url, json={"messages": USER, "max_tokens": -1}), 400, "max_tokens"),
            (client.post(f"/sessions/{target}/samples"), 400, "no committed turn"),
            (client.post("/sessions", json={"sampling_mask": True}), 400, "unknown fields"),
            (client.post("/sessions", json={"return_sampling_mask": 1}), 400, "expected a bool"),
            (
                client.post(f"/sessions/{bystander}/samples", json={"reward": "high"}),
                400,
                "reward",
            ),
            (
                client.post(f"/sessions/{bystander}/samples", json={"max_length": 2.5}),
                400,
                "max_length",
            ),
        ]
        for response, status, needle in cases:
            assert response.status_code == status, response.text
            assert needle in response.json()["error"]["message"]
        assert {sid: info(client, sid) for sid in (bystander, target)} == before
        assert len(server.sessions) == 2 and len(spy.params) == 1  # nothing reached the engine
        turn(client, bystander, [*USER, first, {"role": "user", "content": "ok"}], seed=2)
        assert len(info(client, bystander)["records"]) == 2


def test_standalone_server_publishes_weights_from_disk(tmp_path) -> None:
    from safetensors.torch import save_file

    from furlong.errors import InputError
    from furlong.rollout.sessions.serve import build
    from furlong.serving import background_server

    with pytest.raises(InputError, match="mode: 'never'"):
        build("tiny-qwen3", "never")  # validated before the model loads
    app = build("tiny-qwen3", "abort", max_running=4)
    server = app.state.sessions
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in perturbed(server.engine.model).items()}, path)
    with background_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        sid = open_session(client)
        first = turn(client, sid, USER)
        for body, field in [({"path": str(tmp_path / "nope")}, "path"), ({"version": 2}, "path")]:
            response = client.post("/weights", json=body)
            assert response.status_code == 400 and field in response.json()["error"]["message"]
        bad_version = client.post("/weights", json={"path": str(path), "version": "3"})
        assert bad_version.status_code == 400 and "version" in bad_version.text
        assert client.post("/weights", json={"path": str(path), "version": 3}).json() == {
            "weight_version": 3
        }
        turn(client, sid, [*USER, first, {"role": "user", "content": "again"}])
        assert [r.weight_version for r in server.get(sid).records] == [0, 3]
