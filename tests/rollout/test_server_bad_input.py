"""Hostile input to `furlong rollout-server` over real HTTP on 127.0.0.1: every wrong type,
out-of-range seed, bad shape or oversized body gets a 4xx naming the field (never a 5xx),
nothing reaches the engine, and a normal request afterwards gives the same output as before."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from furlong.models import build_preset
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.server import create_app
from furlong.serving import background_server

pytestmark = pytest.mark.usefixtures("one_thread")
NORMAL = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4, "sampling_seed": 3}}


@pytest.fixture(scope="module")
def served(one_thread):
    engine = EmbeddedEngine(*build_preset("tiny-qwen3", seed=0), max_running=4)
    with background_server(create_app(engine)) as url, httpx.Client(base_url=url) as client:
        expected = client.post("/generate", json=NORMAL).json()["output_ids"]
        yield engine, client, expected


def sp(**fields) -> dict:
    return {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, **fields}}


def assert_unchanged(engine: EmbeddedEngine, client: httpx.Client, expected: list[int]) -> None:
    assert not engine.paused and not engine.offloaded and engine.weight_version == 0
    response = client.post("/generate", json=NORMAL)
    assert response.status_code == 200 and response.json()["output_ids"] == expected


SEEDS = [2**64, 2**64 + 5, 10**30, -1, -(10**30), 1.5, "7", True, [1], {"a": 1}]
BAD_BODIES = [
    *[(sp(sampling_seed=s), "sampling_params.sampling_seed") for s in SEEDS],
    (
        {"input_ids": [[1, 2], [3]], "sampling_params": [{}, {"sampling_seed": 2**64}]},
        "sampling_params[1].sampling_seed",
    ),
    *[
        (sp(**{field: value}), f"sampling_params.{field}")
        for field in ("temperature", "top_p", "min_p")
        for value in ("hot", [], [0.5], {}, True, math.nan, math.inf)
    ],
    *[
        (sp(**{field: value}), f"sampling_params.{field}")
        for field in ("top_k", "max_new_tokens")
        for value in ("5", 2.5, [], True, math.inf, {"k": 1})
    ],
    (sp(max_new_tokens=0), "sampling_params.max_new_tokens"),
    (sp(stop_token_ids=[[1]]), "sampling_params.stop_token_ids[0]"),
    (sp(stop_token_ids=[1, "2"]), "sampling_params.stop_token_ids[1]"),
    (sp(stop_token_ids=[-3]), "sampling_params.stop_token_ids[0]"),
    (sp(stop_token_ids=5), "sampling_params.stop_token_ids"),
    (sp(stop=5), "sampling_params.stop"),
    (sp(stop=["ok", 3]), "sampling_params.stop"),
    (sp(ignore_eos="yes"), "sampling_params.ignore_eos"),
    (sp(skip_special_tokens="no"), "sampling_params.skip_special_tokens"),
    (sp(frequency_penalty=True), "sampling_params.frequency_penalty"),
    (
        {"input_ids": [[1], [2]], "sampling_params": [{}, {"temperature": "hot"}]},
        "sampling_params[1].temperature",
    ),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params: 1 for 2 prompts"),
    ({"input_ids": [1], "sampling_params": "greedy"}, "sampling_params: expected an object"),
    ({**sp(), "return_logprob": "yes"}, "return_logprob"),
    ({**sp(), "return_sampling_mask": 1}, "return_sampling_mask"),
    ({**sp(), "return_routed_experts": "false"}, "return_routed_experts"),
    ({**sp(), "top_logprobs_num": "2"}, "top_logprobs_num"),
    ({**sp(), "top_logprobs_num": -1}, "top_logprobs_num"),
    ({**sp(), "routed_experts_start_len": -2}, "routed_experts_start_len"),
    ({**sp(), "logprob_start_len": "0"}, "logprob_start_len"),
    ({**sp(), "logprob_start_len": True}, "logprob_start_len"),
    ({**sp(), "stream": "no"}, "stream"),
    ({**sp(), "rid": 1.5}, "rid"),
    ({**sp(), "rid": {"id": 1}}, "rid"),
    ({"input_ids": [[1], [2]], "rid": ["a", None]}, "rid[1]"),
    ({"input_ids": [1, -1]}, "input_ids[1]"),
    ({"input_ids": [1, True]}, "input_ids[1]"),
    ({"input_ids": [1, 2.0]}, "input_ids[1]"),
    ({"input_ids": [[1], []]}, "input_ids[1]"),
    ({"input_ids": [[[1]]]}, "input_ids[0][0]"),
    ({"input_ids": "1 2 3"}, "input_ids"),
    ({"input_ids": {"0": 1}}, "input_ids"),
    ({"text": []}, "text"),
    ({"text": [""]}, "text[0]"),
    ({"text": 5}, "text"),
]


@pytest.mark.parametrize(("body", "field"), BAD_BODIES, ids=[f for _, f in BAD_BODIES])
def test_bad_generate_bodies_get_400_naming_the_field(served, body: dict, field: str) -> None:
    engine, client, expected = served
    steps = engine.steps
    response = client.post("/generate", content=json.dumps(body))  # json: NaN allowed
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]
    assert engine.steps == steps and not engine.busy  # nothing was queued
    assert_unchanged(engine, client, expected)


def test_json_nested_too_deeply_is_400(served) -> None:
    engine, client, expected = served
    response = client.post("/generate", content=b"[" * 100_000)
    assert response.status_code == 400 and "body" in response.json()["error"]["message"]
    assert_unchanged(engine, client, expected)


def test_a_body_over_the_limit_is_413(served) -> None:
    engine, _, expected = served
    app = create_app(engine, max_body_bytes=4096)
    with background_server(app) as url, httpx.Client(base_url=url) as client:
        # a declared length over the limit: Starlette answers before reading the body
        response = client.post("/generate", json={"input_ids": [1] * 3000})
        assert response.status_code == 413 and "Too Large" in response.text
        chunks = (b" " * 1024 for _ in range(8))  # no length: refused as it arrives
        response = client.post("/generate", content=chunks)
        assert response.status_code == 413 and "body" in response.json()["error"]["message"]
        assert_unchanged(engine, client, expected)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model_path": "NOT_SAFETENSORS"}, "model_path:"),
        ({"model_path": 5}, "model_path:"),
        ({"model_path": ["/tmp"]}, "model_path:"),
        ({"model_path": "DIR", "weight_version": "v2"}, "weight_version:"),
        ({"model_path": "DIR", "abort_all_requests": "yes"}, "abort_all_requests:"),
    ],
)
def test_bad_weight_updates_are_400_and_change_nothing(served, tmp_path, body, field) -> None:
    engine, client, expected = served
    (tmp_path / "notes.txt").write_text("not a safetensors file")
    paths = {"NOT_SAFETENSORS": str(tmp_path / "notes.txt"), "DIR": str(tmp_path)}
    body = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in body.items()}
    response = client.post("/update_weights_from_disk", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["success"] is False and field in response.json()["message"]
    assert_unchanged(engine, client, expected)
