"""`furlong rollout-server` (SGLang's HTTP protocol) and the `SGLangClient` adapter, on a real
uvicorn server on 127.0.0.1: the adapter gives exactly what the embedded engine gives, the
wire format is SGLang's, bad requests get 400 naming the field, and weights, pausing and
memory work across the process boundary."""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from furlong.errors import InputError
from furlong.models import build_preset
from furlong.models.loading import save_hf_dir
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sampling import SamplingParams
from furlong.rollout.server import create_app
from furlong.rollout.sglang_client import SGLangClient
from furlong.serving import background_server

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def served(one_thread):
    model, tokenizer = build_preset("tiny-qwen3", seed=0)
    engine = EmbeddedEngine(model, tokenizer, max_running=8)
    with background_server(create_app(engine, "tiny-qwen3")) as url, SGLangClient(url) as client:
        yield engine, client, url


@pytest.fixture(scope="module")
def reference(one_thread):
    return EmbeddedEngine(*build_preset("tiny-qwen3", seed=0), max_running=8)


def prompts_of(engine: EmbeddedEngine, n: int = 4) -> list[list[int]]:
    return [engine.tokenizer(f"What is {i} + {3 * i}?")["input_ids"] for i in range(n)]


def assert_same(ours, theirs) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        # batch composition differs (other requests share the server's batch): fp32 noise
        close(a.output_logprobs, b.output_logprobs)
        assert a.sampling_mask == b.sampling_mask
        assert a.weight_version == b.weight_version
        if b.prompt_logprobs is not None:
            assert math.isnan(a.prompt_logprobs[0])
            close(a.prompt_logprobs[1:], b.prompt_logprobs[1:])
        assert (a.top_logprobs is None) == (b.top_logprobs is None)
        for row_a, row_b in zip(a.top_logprobs or [], b.top_logprobs or [], strict=True):
            assert [t for t, _ in row_a] == [t for t, _ in row_b]
            close([lp for _, lp in row_a], [lp for _, lp in row_b])


def close(a: list[float], b: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


def test_adapter_equals_the_embedded_engine(served, reference) -> None:
    engine, client, _ = served
    prompts = prompts_of(engine)
    params = [
        SamplingParams(max_tokens=9, seed=1, top_p=0.9, return_sampling_mask=True),
        SamplingParams(max_tokens=5, seed=2, top_k=7, temperature=0.7, top_logprobs=3),
        SamplingParams(max_tokens=6, seed=3, prompt_logprobs=True, stop_token_ids=()),
        SamplingParams(max_tokens=7, temperature=0, stop=("1",), min_p=0.05),
    ]
    assert_same(client.generate(prompts, params), reference.generate(prompts, params))


def test_routed_experts_over_http_equal_the_engine(one_thread) -> None:
    model, tokenizer = build_preset("tiny-qwen3-moe", seed=0)
    engine = EmbeddedEngine(model, tokenizer)
    local = EmbeddedEngine(*build_preset("tiny-qwen3-moe", seed=0))
    prompts = prompts_of(engine, 2)
    params = [
        SamplingParams(max_tokens=6, seed=0, return_routed_experts=True, stop_token_ids=()),
        SamplingParams(max_tokens=4, seed=1, return_routed_experts=True, routed_experts_start=5),
    ]
    with background_server(create_app(engine)) as url, SGLangClient(url) as client:
        ours = client.generate(prompts, params)
    theirs = local.generate(prompts, params)
    for a, b in zip(ours, theirs, strict=True):
        assert a.routed_experts.dtype == torch.int32
        assert torch.equal(a.routed_experts, b.routed_experts)
        assert a.routed_experts_start == b.routed_experts_start
    assert ours[0].routed_experts.shape[0] == len(prompts[0]) + 6 - 1


def test_wire_format_is_sglangs(served) -> None:
    engine, _, url = served
    prompt = prompts_of(engine, 1)[0]
    greedy = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0]
    stop_at = greedy.output_ids[2]
    body = {
        "input_ids": [prompt, prompt],
        "sampling_params": [
            {"max_new_tokens": 5, "temperature": 0, "stop_token_ids": [stop_at]},
            {"max_new_tokens": 3, "sampling_seed": 4, "ignore_eos": True, "top_k": -1},
        ],
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "rid": "job",
    }
    first, second = httpx.post(f"{url}/generate", json=body).json()
    assert first["output_ids"][-1] == stop_at and len(first["output_ids"]) <= 3
    assert first["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    assert second["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    meta = second["meta_info"]
    assert meta["id"] == "job_1" and meta["prompt_tokens"] == len(prompt)
    assert meta["completion_tokens"] == 3 and meta["weight_version"] == str(engine.weight_version)
    assert [t for _, t, _ in meta["output_token_logprobs"]] == second["output_ids"]
    assert all(text is None and lp <= 0 for lp, _, text in meta["output_token_logprobs"])
    lps = meta["input_token_logprobs"]
    assert lps[0][0] is None and [t for _, t, _ in lps] == prompt
    assert all(len(row) == 2 for row in meta["output_top_logprobs"])
    assert second["text"] == engine.tokenizer.decode(second["output_ids"])
    single = httpx.post(f"{url}/generate", json={"input_ids": prompt}).json()
    assert isinstance(single, dict) and single["meta_info"]["finish_reason"]["type"] in (
        "stop",
        "length",
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": []}, "input_ids: expected a non-empty list"),
        ({"input_ids": [1, 99999]}, r"input_ids\[1\]: token id 99999 outside"),
        ({"input_ids": [[1, 2], [3, "x"]]}, r"input_ids\[1\]\[1\]: expected an integer"),
        ({"input_ids": [1], "text": "hi"}, "give exactly one"),
        (
            {"input_ids": [[1], [2]], "sampling_params": [{}, {"top_p": 2}]},
            r"sampling_params\[1\]\.top_p: must be in \(0, 1\]",
        ),
        ({"input_ids": [1], "sampling_params": {"seed": 3}}, "sampling_params.seed: unknown"),
        (
            {"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}},
            "frequency_penalty: not supported",
        ),
        ({"input_ids": [1], "stream": True}, "stream: streaming is not supported"),
        (
            {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2},
            "logprob_start_len: 2 >= prompt length 2",
        ),
    ],
)
def test_bad_generate_requests_get_400_and_change_nothing(served, body, message) -> None:
    engine, _, url = served
    steps = engine.steps
    response = httpx.post(f"{url}/generate", json=body)
    assert response.status_code == 400
    assert re.search(message, response.json()["error"]["message"])
    assert engine.steps == steps and not engine.busy


def test_bad_control_requests_get_400(served) -> None:
    engine, client, url = served
    bad_json = httpx.post(
        f"{url}/generate", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad_json.status_code == 400 and "body: not JSON" in bad_json.json()["error"]["message"]
    pause = httpx.post(f"{url}/pause_generation", json={"mode": "later"})
    assert pause.status_code == 400 and "mode: 'later'" in pause.json()["error"]["message"]
    tags = httpx.post(f"{url}/release_memory_occupation", json={"tags": ["disk"]})
    assert tags.status_code == 400 and "tags[0]: 'disk'" in tags.json()["error"]["message"]
    update = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": "/nowhere"})
    assert update.status_code == 400 and update.json()["success"] is False
    with pytest.raises(InputError, match="no loadable safetensors weights at '/nowhere'"):
        client.update_weights("/nowhere")
    assert not engine.paused and not engine.offloaded and engine.weight_version == 0


def test_weights_published_across_the_process_boundary(tmp_path, one_thread) -> None:
    model, tokenizer = build_preset("tiny-qwen3", seed=0)
    engine = EmbeddedEngine(model, tokenizer)
    local = EmbeddedEngine(*build_preset("tiny-qwen3", seed=0))
    trained, _ = build_preset("tiny-qwen3", seed=7)  # stands in for the trainer's weights
    save_hf_dir(trained, tokenizer, tmp_path / "step1")
    prompts = prompts_of(engine, 2)
    params = SamplingParams(max_tokens=6, seed=0, stop_token_ids=())
    with background_server(create_app(engine)) as url:
        client = SGLangClient(url, staging_dir=tmp_path / "staging")
        assert client.update_weights(tmp_path / "step1") == 1
        local.update_weights(tmp_path / "step1")
        assert_same(client.generate(prompts, params), local.generate(prompts, params))
        state = {n: p.detach() * 0.5 for n, p in trained.named_parameters()}
        assert client.update_weights(state, version=10) == 10  # a state dict via staging
        local.update_weights(state, version=10)
        assert_same(client.generate(prompts, params), local.generate(prompts, params))
        assert not any((tmp_path / "staging").iterdir())  # staged files are removed
        client.close()

        bucketed = SGLangClient(url, bucket_bytes=4096)  # no staging dir: HTTP buckets
        state = {n: p.detach() * 0.25 for n, p in trained.named_parameters()}
        assert bucketed.update_weights(state) == 11
        local.update_weights(state)
        assert_same(bucketed.generate(prompts, params), local.generate(prompts, params))
        with pytest.raises(InputError, match="unknown tensors"):
            bucketed.update_weights({"nope": torch.zeros(2)})
        assert engine.weight_version == 11
        bucketed.close()


def test_pause_abort_and_memory_over_http(served) -> None:
    engine, client, url = served
    prompt = prompts_of(engine, 1)[0]
    # long enough that a fast machine is still generating when the pause lands (it aborts it)
    long = SamplingParams(max_tokens=1500, seed=0, stop_token_ids=())
    results: list = []
    worker = threading.Thread(target=lambda: results.extend(client.generate([prompt], long)))
    worker.start()
    deadline = time.monotonic() + 30
    while not engine.busy or engine.steps < 3:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert httpx.post(f"{url}/pause_generation", json={}).status_code == 200  # SGLang: abort
    worker.join(timeout=30)
    assert results[0].finish_reason == "abort" and 0 < len(results[0].output_ids) < 1500
    assert engine.paused
    client.offload(["weights"])
    assert engine.offloaded == {"weights"}
    assert httpx.post(f"{url}/resume_memory_occupation", json={"tags": None}).status_code == 400
    client.onload(["weights"])
    client.resume()
    assert not engine.paused
    (done,) = client.generate([prompt], SamplingParams(max_tokens=3, seed=0))
    assert done.finish_reason in ("stop", "length")
    info = httpx.get(f"{url}/get_model_info").json()
    assert info["is_generation"] and info["furlong"]["routed_experts_shape"] is None
    assert httpx.get(f"{url}/health").status_code == 200


def test_cli_serves_the_protocol(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "furlong", "rollout-server", "--model", "tiny-qwen3"]
    proc = subprocess.Popen([*cmd, "--port", str(port)], env=env)
    try:
        client = SGLangClient(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 120
        while not client.health():
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        (r,) = client.generate([[1, 2, 3]], SamplingParams(max_tokens=4, seed=0))
        assert 1 <= len(r.output_ids) <= 4 and r.weight_version == 0
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
