"""``POST /sessions/{id}/samples`` on the real server (127.0.0.1): the rollout codec's payload
by content negotiation, JSON under the same allowlist, opt-in with ``?fields=``, and a
receiver that did not opt in failing loudly."""

from __future__ import annotations

import pytest
import torch

from furlong.errors import InputError
from furlong.rollout.codec import MEDIA_TYPE, decode_samples, encode_samples, opt_in
from furlong.rollout.sessions.wire import sample_from_json

from .session_helpers import open_session, serve, turn

pytestmark = pytest.mark.usefixtures("one_thread")
USER = [{"role": "user", "content": "What is 2 + 3?"}]
CODEC = {"accept": MEDIA_TYPE}
BOTH = opt_in("sampling_mask", "routed_experts")


def two_turns(client, sid: str, **params) -> None:
    first = turn(client, sid, USER, seed=1, max_tokens=6, **params)
    turn(client, sid, [*USER, first, {"role": "tool", "content": "5"}], seed=2, max_tokens=6)


def test_default_payload_is_the_codecs_default_encoding() -> None:
    with serve() as (server, _, client):
        sid = open_session(client)
        two_turns(client, sid)
        url = f"/sessions/{sid}/samples"
        response = client.post(url, json={"reward": 1.0}, headers=CODEC)
        assert response.headers["content-type"] == MEDIA_TYPE
        expected = encode_samples([server.sample(sid, 1.0)])
        assert response.content == expected  # byte for byte
        body = client.post(url, json={"reward": 1.0}).json()["samples"][0]
        assert "sampling_mask" not in body and "routed_experts" not in body
        (decoded,) = decode_samples(response.content)
        assert torch.equal(decoded.tokens, sample_from_json(body).tokens)
        bad = client.post(f"{url}?fields=sampling_mask,logits")
        assert bad.status_code == 400 and "fields" in bad.json()["error"]["message"]


def test_opt_in_round_trips_and_a_receiver_that_did_not_opt_in_fails() -> None:
    with serve("tiny-qwen3-moe") as (server, _, client):
        sid = open_session(client, return_sampling_mask=True)
        two_turns(client, sid, top_k=5)
        truth = server.sample(sid)
        assert truth.sampling_mask is not None and truth.routed_experts is not None
        url = f"/sessions/{sid}/samples"
        opted = client.post(f"{url}?fields=routed_experts,sampling_mask", headers=CODEC)
        as_json = client.post(f"{url}?fields=sampling_mask,routed_experts").json()
        for got in (
            decode_samples(opted.content, BOTH)[0],
            sample_from_json(as_json["samples"][0], BOTH),
        ):
            assert got.sampling_mask == truth.sampling_mask
            assert torch.equal(got.routed_experts, truth.routed_experts)
            assert torch.equal(got.rollout_logprobs, truth.rollout_logprobs)
        # not opted in: the server still sends what the sample carries, the receiver refuses it
        plain = client.post(url, headers=CODEC).content
        assert plain == encode_samples([truth], BOTH)
        with pytest.raises(InputError, match="'sampling_mask', 'routed_experts'.*did not opt in"):
            decode_samples(plain)
        body = client.post(f"{url}?fields=sampling_mask").json()["samples"][0]
        with pytest.raises(InputError, match=r"\['routed_experts'\] the receiver did not opt in"):
            sample_from_json(body, opt_in("sampling_mask"))
