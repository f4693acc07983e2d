"""The session server over SGLang's HTTP protocol: an `SGLangClient` pointing at `furlong
rollout-server` gives the same trajectories as the embedded engine (dense, and MoE with
incremental routing replay), a publication under `abort` turns an in-flight remote turn into
a 503, and closing a session aborts its request on the server."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch

from furlong.errors import InputError
from furlong.rollout.codec import opt_in
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sample import Sample
from furlong.rollout.server import create_app
from furlong.rollout.sessions.wire import sample_from_json
from furlong.rollout.sglang_client import SGLangClient
from furlong.serving import background_server

from .session_helpers import chat, info, model, open_session, perturbed, serve, turn

pytestmark = pytest.mark.usefixtures("one_thread")
USER = [{"role": "user", "content": "What is 2 + 3?"}]


@contextmanager
def remote(preset: str, **config) -> Iterator[tuple[EmbeddedEngine, object, object]]:
    """A session server whose engine is an ``SGLangClient`` on a rollout server; yields the
    rollout server's engine, the session server and its HTTP client."""
    backend = EmbeddedEngine(*model(preset))
    with background_server(create_app(backend)) as url:
        engine = SGLangClient(
            url, tokenizer=backend.tokenizer, context_length=backend.context_length
        )
        try:
            with serve(preset, engine=engine, **config) as (server, _, client):
                yield backend, server, client
        finally:
            engine.close()


def two_turns(server, client) -> Sample:
    """A seeded chat: a user turn, a tool result, a second turn; the session's sample."""
    sid = open_session(client, return_sampling_mask=True)
    first = turn(client, sid, USER, seed=3, top_p=0.9, max_tokens=10)
    tool = {"role": "tool", "content": "5"}
    turn(client, sid, [*USER, first, tool], seed=4, top_p=0.9, max_tokens=10)
    fields = "sampling_mask,routed_experts" if server.replay else "sampling_mask"
    body = client.post(f"/sessions/{sid}/samples?fields={fields}").json()["samples"][0]
    return sample_from_json(body, opt_in(*fields.split(",")))


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_a_session_over_sglang_equals_one_over_the_embedded_engine(preset: str) -> None:
    with remote(preset) as (_, server, client):
        assert server.replay == (preset == "tiny-qwen3-moe")  # the router came over HTTP
        ours = two_turns(server, client)
    with serve(preset) as (server, _, client):
        theirs = two_turns(server, client)
    assert ours.tokens.tolist() == theirs.tokens.tolist()
    assert ours.prompt_length == theirs.prompt_length
    assert torch.equal(ours.loss_mask, theirs.loss_mask)
    assert (ours.loss_mask == 0).any()  # the tool tokens
    torch.testing.assert_close(ours.rollout_logprobs, theirs.rollout_logprobs, atol=1e-5, rtol=0)
    assert ours.sampling_mask == theirs.sampling_mask
    if preset == "tiny-qwen3-moe":  # incremental R3, assembled from the remote records
        assert ours.routed_experts.shape[0] == ours.tokens.numel() - 1
        assert torch.equal(ours.routed_experts, theirs.routed_experts)
    else:
        assert ours.routed_experts is None and theirs.routed_experts is None


def wait_until_queued(engine: EmbeddedEngine) -> None:
    deadline = time.monotonic() + 30
    while not engine.busy:
        assert time.monotonic() < deadline, "the turn never reached the rollout server"
        time.sleep(0.002)


def test_a_publish_under_abort_turns_a_remote_turn_into_503() -> None:
    with remote("tiny-qwen3-moe", pause_mode="abort") as (backend, server, client):
        sid = open_session(client)
        first = turn(client, sid, USER, seed=1)
        before = info(client, sid)
        messages = [*USER, first, {"role": "tool", "content": "5"}]
        backend.pause("in_place")  # hold the next turn in the rollout server's queue
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(chat, client, sid, messages, seed=2)
            wait_until_queued(backend)
            assert server.publish_weights(perturbed(backend.model), 1) == 1
            response = pending.result(timeout=60)
        assert response.status_code == 503, response.text
        after = info(client, sid)
        assert [a["reason"] for a in after.pop("aborted")] == ["engine"]
        assert after == {k: v for k, v in before.items() if k != "aborted"}  # nothing committed
        turn(client, sid, messages, seed=2)  # the retry runs under the new weights
        assert [r.weight_version for r in server.get(sid).records] == [0, 1]
        assert backend.weight_version == 1 and not backend.paused


def test_a_refused_remote_publication_aborts_no_turn() -> None:
    """The rollout server reports its parameters' names and shapes, so the session server
    checks a publication before it pauses the remote engine."""
    with remote("tiny-qwen3", pause_mode="abort") as (backend, server, client):
        sid = open_session(client)
        backend.pause("in_place")
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(chat, client, sid, USER)
            wait_until_queued(backend)
            name, param = next(iter(backend.model.named_parameters()))
            for bad in ({"not.a.weight": param.detach()}, {name: torch.zeros(2, 2)}):
                with pytest.raises(InputError, match="update_weights: "):
                    server.publish_weights(bad)
            assert backend.paused and backend.busy and backend.weight_version == 0
            backend.resume()
            assert pending.result(timeout=60).status_code == 200
        assert info(client, sid)["aborted"] == []


def test_closing_a_session_aborts_its_request_on_the_server() -> None:
    with remote("tiny-qwen3") as (backend, server, client):
        sid = open_session(client)
        backend.pause("in_place")
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(chat, client, sid, USER)
            wait_until_queued(backend)
            assert client.delete(f"/sessions/{sid}").status_code == 200
            response = pending.result(timeout=60)
        backend.resume()
        assert response.status_code == 404 and "closed" in response.json()["error"]["message"]
        assert not backend.busy  # aborted on the server, by its request id
        assert server.sessions == {}
