"""Routing-replay bugs other frameworks shipped (miles #3277/#3282, #3307, #3337), through a
real session server on 127.0.0.1 over an MoE model, with weights that change mid-run so that a
recomputed route differs from the one a token was sampled with:

(a) a turn retracted mid-generation keeps, for every position it had sampled from, the route
    it sampled with, not the route its re-prefill recomputed under the new weights;
(b) a later turn's prefill never overwrites an earlier turn's routes, in every pause mode;
(c) an aborted reply is never stored as a finished turn, whatever status reached the client.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from furlong.rollout.codec import opt_in
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sample import Sample
from furlong.rollout.sampling import SamplingParams
from furlong.rollout.sessions.wire import sample_from_json

from .session_helpers import chat, info, model, open_session, perturbed, serve, turn

pytestmark = pytest.mark.usefixtures("one_thread")
MOE = "tiny-qwen3-moe"
USER = [{"role": "user", "content": "What is 2 + 3?"}]
TOOL = {"role": "tool", "content": "5"}


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def routed(client: httpx.Client, sid: str) -> Sample:
    response = client.post(f"/sessions/{sid}/samples?fields=routed_experts")
    assert response.status_code == 200, response.text
    return sample_from_json(response.json()["samples"][0], opt_in("routed_experts"))


def rows_under(weights: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """Oracle: the routes of one prefill of ``tokens`` under ``weights``."""
    net, tokenizer = model(MOE)
    net.load_state_dict(weights, strict=False)
    params = SamplingParams(max_tokens=1, temperature=0, return_routed_experts=True)
    (result,) = EmbeddedEngine(net, tokenizer).generate([tokens], params)
    return result.routed_experts


def state(engine: EmbeddedEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


# ---------------------------------------------------------------- (a) retract mid-turn


def test_a_retracted_turn_replays_the_routes_it_sampled_with() -> None:
    engine = EmbeddedEngine(*model(MOE))
    old, new = state(engine), perturbed(engine.model)
    k = 4  # tokens sampled before the publication
    reached, gate = threading.Event(), threading.Event()
    record = engine._record

    def held_at_k(request, draw):  # the engine stops inside its k-th draw until released
        reason = record(request, draw)
        if len(request.output) == k and not gate.is_set():
            reached.set()
            gate.wait(30)
        return reason

    engine._record = held_at_k
    with serve(engine=engine, pause_mode="retract") as (server, spy, client):
        sid = open_session(client)
        with ThreadPoolExecutor(2) as pool:
            pending = pool.submit(chat, client, sid, USER, seed=3, max_tokens=12)
            assert reached.wait(30)
            publishing = pool.submit(server.publish_weights, new, 1)
            wait_for(lambda: engine._pause_request is not None, "no pause was asked for")
            gate.set()  # the step ends, the pause retracts the turn, the weights change
            assert publishing.result(timeout=60) == 1
            assert pending.result(timeout=60).status_code == 200
        sample = routed(client, sid)
    (record_,) = server.get(sid).records
    prompt, params = spy.prompts[0], spy.params[0]
    assert len(record_.output_ids) > k and record_.weight_version == 1
    # what the first k tokens were sampled with: the same request under the old weights
    before = EmbeddedEngine(*model(MOE))
    (ref,) = before.generate([prompt], dataclasses.replace(params, max_tokens=k))
    assert record_.output_ids[:k] == ref.output_ids
    used = len(prompt) + k - 1  # positions whose logits drew a token before the pause
    assert ref.routed_experts.shape[0] == used
    assert torch.equal(sample.routed_experts[:used], ref.routed_experts)
    recomputed = rows_under(new, sample.tokens[:used].tolist())
    assert not torch.equal(recomputed, ref.routed_experts)  # the bug would have shown
    assert sample.routed_experts.shape[0] == sample.tokens.numel() - 1
    assert all(torch.equal(state(before)[n], t) for n, t in old.items())  # same old weights


# ---------------------------------------------------------------- (b) later prefill


@pytest.mark.parametrize("mode", ["abort", "in_place", "retract"])
def test_a_later_turns_prefill_never_overwrites_earlier_routes(mode: str) -> None:
    with serve(MOE, pause_mode=mode) as (server, spy, client):
        sid = open_session(client)
        first = turn(client, sid, USER, seed=1, max_tokens=8)
        one = routed(client, sid)
        new = perturbed(spy.engine.model)
        server.publish_weights(new, 1)
        turn(client, sid, [*USER, first, TOOL], seed=2, max_tokens=8)
        two = routed(client, sid)
    earlier = one.tokens.numel() - 1  # turn 1's rows; its last token is fed by turn 2
    assert torch.equal(two.tokens[: one.tokens.numel()], one.tokens)
    assert torch.equal(two.routed_experts[:earlier], one.routed_experts)
    # under the new weights those positions route otherwise: an overwrite would show
    assert not torch.equal(rows_under(new, one.tokens[:-1].tolist()), one.routed_experts)


# ---------------------------------------------------------------- (c) aborted replies


def aborted_in_a_200(result):
    """A remote engine that answers 200 with an aborted completion (SGLang's shape)."""
    return dataclasses.replace(result, finish_reason="abort")


@pytest.mark.parametrize(
    "cause", ["weight update", "abort request", "abort in a 200 reply", "hang-up", "close"]
)
def test_an_aborted_reply_is_never_stored_as_a_finished_turn(cause: str) -> None:
    faulty = {"armed": False}

    def edit(result):
        return aborted_in_a_200(result) if faulty["armed"] else result

    with serve(MOE, pause_mode="abort", edit=edit) as (server, spy, client):
        engine = spy.engine
        sid = open_session(client)
        first = turn(client, sid, USER, seed=1)
        records, tokens = list(server.get(sid).records), info(client, sid)["tokens"]
        messages = [*USER, first, TOOL]
        faulty["armed"] = cause == "abort in a 200 reply"
        if cause != "abort in a 200 reply":
            engine.pause("in_place")  # the turn waits in the engine for what ends it
        with ThreadPoolExecutor(1) as pool:
            if cause == "hang-up":
                body = {"messages": messages, "max_tokens": 8, "seed": 2}
                with pytest.raises(httpx.ReadTimeout):
                    client.post(f"/sessions/{sid}/v1/chat/completions", json=body, timeout=0.3)
                wait_for(lambda: info(client, sid)["aborted"], "the hang-up was not noticed")
                status = None
            else:
                pending = pool.submit(chat, client, sid, messages, seed=2)
                if cause != "abort in a 200 reply":
                    wait_for(lambda: engine.busy, "the turn never reached the engine")
                if cause == "weight update":
                    server.publish_weights(perturbed(engine.model), 1)
                elif cause == "abort request":
                    engine.abort()
                elif cause == "close":
                    client.delete(f"/sessions/{sid}")
                status = pending.result(timeout=60).status_code
        engine.resume()
        if cause == "close":
            assert status == 404 and server.sessions == {}
            return
        assert status in (503, None)
        assert server.get(sid).records == records and info(client, sid)["tokens"] == tokens
        (aborted,) = info(client, sid)["aborted"]
        assert aborted["reason"] == ("client_disconnected" if cause == "hang-up" else "engine")
        faulty["armed"] = False
        turn(client, sid, messages, seed=2)  # the retry commits as the second turn
        assert len(server.get(sid).records) == 2
