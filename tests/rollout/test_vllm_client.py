"""The vLLM kind (furlong/rollout/vllm_client.py) against a stand-in for vLLM's routes on
127.0.0.1 (fake_vllm.py): the order of a publication, versions on results, aborts, several
clients on one server, and refusals. test_vllm_real.py runs it against real vLLM."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from furlong.errors import InputError
from furlong.models.presets import build_preset
from furlong.rollout.base import RolloutEngine, SamplingEngine, SessionEngine
from furlong.rollout.registry import EngineRequest, build_engine
from furlong.rollout.sampling import SamplingParams
from furlong.rollout.vllm_client import VLLMClient
from furlong.serving import background_server
from tests.rollout.fake_vllm import FakeVLLM


@pytest.fixture
def fake() -> Iterator[tuple[FakeVLLM, str]]:
    server = FakeVLLM()
    with background_server(server.app()) as url:
        yield server, url


@pytest.fixture(scope="module")
def tiny():
    return build_preset("tiny-qwen3", seed=0)


def running(server: FakeVLLM, timeout: float = 10.0) -> None:
    """Until the server is generating a request."""
    deadline = time.monotonic() + timeout
    while not server.in_flight:
        assert time.monotonic() < deadline, "no request reached the server"
        time.sleep(0.005)


def _client(url: str, tiny, tmp_path, need: type = RolloutEngine, **options) -> VLLMClient:
    model, tokenizer = tiny
    options = {"urls": [url], "staging_dir": str(tmp_path / "staging"), **options}
    request = EngineRequest(model, tokenizer, max_running=4, private=True, options=options)
    return build_engine("vllm", request, need)


def test_the_policy_is_published_as_version_0_in_order(fake, tiny, tmp_path):
    server, url = fake
    with _client(url, tiny, tmp_path) as client:
        assert server.calls == [
            "pause:wait",  # requests in flight finish under the old weights
            "rpc:reload_weights",
            "version:0",
            "reset_prefix_cache",
            "resume",
        ]
        assert client.weight_version == 0 and client.context_length == 256
        # the directory the server loaded holds the policy's tensors, by checkpoint name
        assert len(server.reloads) == 1


def test_a_publication_changes_the_output_and_its_results_say_which(fake, tiny, tmp_path):
    server, url = fake
    model, _ = tiny
    with _client(url, tiny, tmp_path) as client:
        params = SamplingParams(max_tokens=3, stop_token_ids=())
        before = client.generate([[5, 6]], params)[0]
        weights = {n: p.detach() * 1.01 for n, p in model.named_parameters()}
        assert client.update_weights(weights, 4) == 4
        after = client.generate([[5, 6]], params)[0]
        assert (before.weight_version, after.weight_version) == (0, 4)
        assert before.output_ids != after.output_ids
        assert server.calls[-5:] == ["pause:wait", "rpc:reload_weights", "version:4",
                                     "reset_prefix_cache", "resume"]  # fmt: skip
        # the served model's context bounds a request before it is sent
        with pytest.raises(InputError, match=r"params\[0\]\.max_tokens: 2 prompt tokens"):
            client.generate([[5, 6]], SamplingParams(max_tokens=255))
        assert len(server.bodies) == 2


def test_the_request_carries_furlongs_stop_ids_seed_and_id(fake, tiny, tmp_path):
    server, url = fake
    model, _ = tiny
    with _client(url, tiny, tmp_path, SessionEngine) as client:
        future = client.submit([3, 4], SamplingParams(max_tokens=4, seed=11), request_id="r-1")
        result = future.result(timeout=10)
        body = server.bodies[-1]
        assert body["request_id"] == "r-1" and body["sampling_params"]["seed"] == 11
        assert body["sampling_params"]["stop_token_ids"] == [model.generation_config.eos_token_id]
        assert result.request_id == "r-1" and result.output_logprobs == [-0.5] * 4


def test_an_abort_reaches_the_request_by_vllms_id(fake, tiny, tmp_path):
    server, url = fake
    server.token_delay = 0.05
    with _client(url, tiny, tmp_path, SessionEngine) as client:
        future = client.submit([3], SamplingParams(max_tokens=200, stop_token_ids=()), "long")
        running(server)
        time.sleep(0.1)  # a few tokens in
        assert client.abort(["long"]) == 1
        result = future.result(timeout=10)
        assert result.finish_reason == "abort" and 0 < len(result.output_ids) < 200
        assert "generate-tokens-long" in server.aborted


def test_a_publication_waits_for_requests_in_flight(fake, tiny, tmp_path):
    """Never mixed: a request running when a publication starts finishes under the old weights
    (vLLM's pause mode "wait"), and the next one runs under the new."""
    server, url = fake
    model, _ = tiny
    server.token_delay = 0.02
    with _client(url, tiny, tmp_path) as client:
        first = client._pool.submit(
            client.generate, [[7]], SamplingParams(max_tokens=20, stop_token_ids=())
        )
        running(server)
        weights = {n: p.detach() * 0.5 for n, p in model.named_parameters()}
        client.update_weights(weights, 1)
        assert first.result(timeout=10)[0].weight_version == 0
        assert len(first.result()[0].output_ids) == 20
        assert client.generate([[7]], SamplingParams(max_tokens=2))[0].weight_version == 1


def test_clients_on_one_server_take_turns_with_their_own_weights(fake, tiny, tmp_path):
    """The Tinker service's snapshot engines: each samples under its own weights, loaded when
    its turn comes (the other's requests finish first)."""
    server, url = fake
    model, tokenizer = tiny
    a = _client(url, tiny, tmp_path, SamplingEngine)
    other = {n: p.detach() + 0.01 for n, p in model.named_parameters()}
    b = _client(url, tiny, tmp_path, SamplingEngine)
    b.update_weights(other, 0)
    try:
        params = SamplingParams(max_tokens=3, stop_token_ids=())
        out_b = b.submit([9], params).result(timeout=10).output_ids
        out_a = a.submit([9], params).result(timeout=10).output_ids
        assert out_a != out_b
        assert a.submit([9], params).result(timeout=10).output_ids == out_a
        assert b.submit([9], params).result(timeout=10).output_ids == out_b
        assert server.calls.count("rpc:reload_weights") == 5  # a, b, b's update, a, b
    finally:
        a.close()
        b.close()


def test_concurrent_requests_of_two_clients_are_never_served_the_wrong_weights(
    fake, tiny, tmp_path
):
    server, url = fake
    model, _ = tiny
    server.token_delay = 0.002
    a = _client(url, tiny, tmp_path, SamplingEngine)
    b = _client(url, tiny, tmp_path, SamplingEngine)
    b.update_weights({n: p.detach() + 0.02 for n, p in model.named_parameters()}, 0)
    params = SamplingParams(max_tokens=4, stop_token_ids=())
    try:
        expect = {
            c: c.submit([1], params).result(timeout=10).output_ids for c in (a, b)
        }  # each alone
        results: list[tuple[VLLMClient, list[int]]] = []
        lock = threading.Lock()

        def run(c: VLLMClient) -> None:
            out = c.submit([1], params).result(timeout=30).output_ids
            with lock:
                results.append((c, out))

        threads = [threading.Thread(target=run, args=(c,)) for c in [a, b] * 6]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 12 and all(out == expect[c] for c, out in results)
    finally:
        a.close()
        b.close()


def test_check_weights_refuses_an_unknown_name_before_anything_moves(fake, tiny, tmp_path):
    server, url = fake
    with _client(url, tiny, tmp_path) as client:
        calls = list(server.calls)
        with pytest.raises(InputError, match="unknown tensors"):
            client.update_weights({"model.nope.weight": torch.zeros(2)}, 1)
        assert server.calls == calls and client.weight_version == 0


def test_what_vllm_cannot_do_is_one_line(fake, tiny, tmp_path):
    _, url = fake
    with _client(url, tiny, tmp_path, SessionEngine) as client:
        with pytest.raises(InputError, match=r"'retract' has no vLLM counterpart"):
            client.pause("retract")
        with pytest.raises(InputError, match="sleep/wake_up"):
            client.offload(["weights"])
        with pytest.raises(InputError, match="return_sampling_mask"):
            client.submit([1], SamplingParams(return_sampling_mask=True))
        with pytest.raises(InputError, match=r"prompts\[0\]\[1\]: id 9999 is outside"):
            client.submit([1, 9999], SamplingParams())


def test_an_moe_policy_is_refused(fake, tmp_path):
    _, url = fake
    model, tokenizer = build_preset("tiny-qwen3-moe", seed=0)
    request = EngineRequest(model, tokenizer, options={"urls": [url]})
    with pytest.raises(InputError, match=r"MoE routes for routing replay \(R3\)"):
        build_engine("vllm", request, RolloutEngine)


def test_a_server_without_the_token_routes_is_named(tiny, tmp_path):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": [{"max_model_len": 64}]}

    @app.post("/pause")
    async def pause() -> JSONResponse:
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    with background_server(app) as url, pytest.raises(InputError, match="VLLM_SERVER_DEV_MODE=1"):
        _client(url, tiny, tmp_path)


def test_a_remote_server_needs_a_staging_dir(tiny):
    model, tokenizer = tiny
    request = EngineRequest(model, tokenizer, options={"urls": ["http://10.1.2.3:8000"]})
    with pytest.raises(InputError, match="rollout.staging_dir: http://10.1.2.3:8000 is not on"):
        build_engine("vllm", request, RolloutEngine)


def test_names_the_server_does_not_serve_are_refused_before_any_reload(fake, tiny, tmp_path):
    """A reload that meets an unknown name fails half done in vLLM and leaves its model broken
    (seen: meta tensors, a server that no longer generates), so the names are checked first,
    through vLLM's fused q/k/v and gate/up names."""
    from furlong.rollout.vllm_client import vllm_name

    server, url = fake
    model, _ = tiny
    served = {vllm_name(n) for n, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in served
    server.checksums = {f"dp0:pp0:pcp0:tp0:{n}": "0" for n in served}
    _client(url, tiny, tmp_path).close()  # every name found: accepted
    served.discard("model.layers.1.mlp.gate_up_proj.weight")
    server.checksums = {f"dp0:pp0:pcp0:tp0:{n}": "0" for n in served}
    reloads = len(server.reloads)
    with pytest.raises(InputError, match=r"serves no parameters named \['model.layers.1.mlp.gate"):
        _client(url, tiny, tmp_path)
    assert len(server.reloads) == reloads


def test_staging_is_the_fleets_own_and_a_dead_processs_is_swept(fake, tiny, tmp_path, monkeypatch):
    from furlong.rollout import vllm_client

    _, url = fake
    root = tmp_path / "shm"
    root.mkdir()
    dead = root / f"{vllm_client.STAGING_PREFIX}999999999-abc"  # no such process
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"x" * 64)
    live = root / f"{vllm_client.STAGING_PREFIX}{os.getpid()}-other"  # this process's: kept
    live.mkdir()
    monkeypatch.setattr(vllm_client, "SHM", root)
    model, tokenizer = tiny
    request = EngineRequest(model, tokenizer, options={"urls": [url]})
    client = build_engine("vllm", request, RolloutEngine)
    assert not dead.exists() and live.exists()
    ours = client.staging_dir
    assert ours.parent == root and ours.name.startswith(
        f"{vllm_client.STAGING_PREFIX}{os.getpid()}-"
    )
    assert len(list(ours.glob("weights-*/model.safetensors"))) == 1  # the last publication only
    client.close()
    assert not ours.exists() and live.exists()


def test_a_fleet_never_released_leaves_no_staging_at_exit(fake, tmp_path):
    """The Tinker service never closes its sampler engines: the process's exit removes them."""
    import subprocess
    import sys

    _, url = fake
    script = (
        "import sys\n"
        "from furlong.models.presets import build_preset\n"
        "from furlong.rollout.base import RolloutEngine\n"
        "from furlong.rollout.registry import EngineRequest, build_engine\n"
        "model, tok = build_preset('tiny-qwen3', seed=0)\n"
        "options = {'urls': [sys.argv[1]], 'staging_dir': sys.argv[2]}\n"
        "client = build_engine('vllm', EngineRequest(model, tok, options=options), RolloutEngine)\n"
        "print(client.staging_dir)\n"  # and exit without close()
    )
    root = tmp_path / "staging"
    out = subprocess.run(
        [sys.executable, "-c", script, url, str(root)], capture_output=True, text=True, check=True
    )
    staging = out.stdout.strip().splitlines()[-1]
    assert staging.startswith(str(root)) and list(root.iterdir()) == []
