"""Hostile and oversized input against a real `furlong serve` on 127.0.0.1, through the official
SDK where it applies: bounded memory before allocation, refusals that consume their seq_id,
finite JSON, 4xx instead of 5xx, and fair sampling between tenants."""

from __future__ import annotations

import math
import threading

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from tinker import types as tt
from tinker.proto import tinker_public_pb2 as pb

from furlong.server.proto import PROTOBUF
from tests.server.test_protocol import BASE, Wire, data, losses, serve

pytestmark = pytest.mark.usefixtures("one_thread")
CONTEXT = 2048  # tiny-qwen3's max_position_embeddings


@pytest.fixture(scope="module")
def hardened(tmp_path_factory, one_thread):
    service, server = serve(
        tmp_path_factory.mktemp("hard"),
        app_kwargs={"max_body_bytes": 1 << 20},
        compress_fwdbwd=True,
        gap_timeout=20.0,
        poll_timeout=2.0,
        max_samples=64,
        max_sample_tokens=16,
        sampler_slots=4,
    )
    with server as url:
        yield service, url


def sdk(url: str, key: str = "tml-hard") -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=url, api_key=key)


def rest(url: str, key: str = "tml-hard") -> tinker.RestClient:
    return tinker.RestClient(base_url=url, api_key=key)


def post_fwdbwd(wire: Wire, msg: pb.ForwardBackwardRequest, **headers) -> httpx.Response:
    return wire.http.post(
        "/forward_backward",
        content=msg.SerializeToString(),
        headers={"Content-Type": PROTOBUF, **headers},
    )


def fwdbwd_msg(wire: Wire, model: str, seq_id: int, n: int = 1) -> pb.ForwardBackwardRequest:
    return pb.ForwardBackwardRequest.FromString(wire.fwdbwd_body(model, seq_id, data(0, n)))


def sparse_targets(datum: pb.Datum, rows: int, cols: int) -> None:
    """A few bytes of CSR that declare a ``rows x cols`` dense tensor."""
    t = datum.loss_fn_inputs["target_tokens"]
    t.Clear()
    t.dtype = pb.DTYPE_INT64
    t.shape.extend([rows, cols])
    t.sparse_csr.values = np.array([1], "<i8").tobytes()
    t.sparse_csr.col_indices = np.array([0], "<i8").tobytes()
    t.sparse_csr.crow_indices = np.array([0] + [1] * rows, "<i8").tobytes()


# ---------------------------------------------------------------- 1. decompression bombs


def test_a_zstd_bomb_is_refused_at_the_inflated_limit(hardened) -> None:
    service, url = hardened
    wire = Wire(url)
    model = wire.new_model()
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(64 << 20))
    assert len(bomb) < 64 << 10
    r = wire.http.post(
        "/forward_backward",
        content=bomb,
        headers={"Content-Type": PROTOBUF, "Content-Encoding": "zstd"},
    )
    assert r.status_code == 400
    assert "body: decompressed size exceeds the limit of 1048576 bytes" in r.json()["detail"]
    out = wire.result(wire.fwdbwd(model, 1, data(1), forward_only=True).json())
    assert math.isfinite(losses(out))


def test_zstd_is_refused_when_the_server_did_not_ask_for_it(tmp_path) -> None:
    _, server = serve(tmp_path)
    with server as url:
        wire = Wire(url)
        model = wire.new_model()
        body = zstandard.ZstdCompressor().compress(wire.fwdbwd_body(model, 1, data(1)))
        r = wire.http.post(
            "/forward_backward",
            content=body,
            headers={"Content-Type": PROTOBUF, "Content-Encoding": "zstd"},
        )
        assert r.status_code == 400 and "Content-Encoding: zstd" in r.json()["detail"]


def test_parsing_runs_off_the_event_loop(hardened, monkeypatch) -> None:
    service, url = hardened
    wire = Wire(url)
    model = wire.new_model()
    entered, release = threading.Event(), threading.Event()
    original = service.decode_forward_backward

    def slow(body, encoding, max_bytes):
        entered.set()
        release.wait(30)
        return original(body, encoding, max_bytes)

    monkeypatch.setattr(service, "decode_forward_backward", slow)
    worker = threading.Thread(target=lambda: wire.fwdbwd(model, 1, data(2), forward_only=True))
    worker.start()
    try:
        assert entered.wait(30)
        health = httpx.get(url + "/api/v1/healthz", timeout=10)  # served while a body parses
        assert health.status_code == 200
    finally:
        release.set()
        worker.join(60)


def test_a_chunked_body_over_the_limit_is_413(hardened) -> None:
    _, url = hardened

    def chunks():
        for _ in range(40):
            yield bytes(64 << 10)  # no Content-Length: sent chunked, 2.5 MiB in all

    r = httpx.post(
        url + "/api/v1/optim_step",
        content=chunks(),
        headers={"X-API-Key": "tml-hard", "Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413 and "the limit is 1048576" in r.json()["detail"]


# ---------------------------------------------------------------- 2. sparse amplification


def test_sparse_tensors_are_capped_per_tensor_and_per_request(hardened) -> None:
    service, url = hardened
    wire = Wire(url)
    model = wire.new_model()
    msg = fwdbwd_msg(wire, model, 1)
    sparse_targets(msg.data[0], 2048, 131072)  # 2**28 elements: 2 GiB of int64 once dense
    assert len(msg.SerializeToString()) < 64 << 10
    r = post_fwdbwd(wire, msg)
    assert r.status_code == 400
    assert (
        "data[0].loss_fn_inputs['target_tokens']: 268435456 elements once dense; "
        "the limit is 4194304" in r.json()["detail"]
    )
    msg = fwdbwd_msg(wire, model, 2, n=17)  # each under the tensor cap, 16 (+ tokens) over
    for datum in msg.data:
        sparse_targets(datum, 1024, 4096)
    r = post_fwdbwd(wire, msg)
    assert r.status_code == 400
    assert (
        "data[15].loss_fn_inputs['target_tokens']: the request's tensors pass 67108864"
        in (r.json()["detail"])
    )
    # both refusals consumed their seq_ids: the model's next operation runs at once
    out = wire.result(wire.fwdbwd(model, 3, data(1), forward_only=True).json())
    assert math.isfinite(losses(out))


# ---------------------------------------------------------------- 3. bounded sampling


def test_sampling_is_bounded_by_the_context_and_the_caps(hardened) -> None:
    _, url = hardened
    caps = rest(url).get_server_capabilities().result().supported_models
    assert [(m.model_name, m.max_context_length) for m in caps] == [(BASE, CONTEXT)]
    sampler = sdk(url).create_sampling_client(base_model=BASE).result()
    free = tt.SamplingParams(max_tokens=4, seed=1, stop=[])
    with pytest.raises(Exception, match=r"prompt: 2100 tokens leave no room .* context of 2048"):
        sampler.sample(tt.ModelInput.from_ints([7] * 2100), 1, free).result()
    long_prompt = tt.ModelInput.from_ints([7] * 2040)
    with pytest.raises(Exception, match=r"sampling_params\.max_tokens: 12 is more than the 8"):
        sampler.sample(long_prompt, 1, tt.SamplingParams(max_tokens=12, stop=[])).result()
    with pytest.raises(Exception, match=r"num_samples: must be in \[1, 64\], got 65"):
        sampler.sample(long_prompt, 65, free).result()
    prompt = tt.ModelInput.from_ints([7, 8, 9])
    with pytest.raises(Exception, match=r"sampling_params\.max_tokens: 17 is more than the 16"):
        sampler.sample(prompt, 1, tt.SamplingParams(max_tokens=17, stop=[])).result()
    # no max_tokens: as many as the server's cap and the context allow
    unbounded = tt.SamplingParams(seed=2, stop=[])
    assert len(sampler.sample(prompt, 1, unbounded).result().sequences[0].tokens) == 16
    assert len(sampler.sample(long_prompt, 1, unbounded).result().sequences[0].tokens) == 8


def test_a_small_sample_is_not_queued_behind_another_tenants_big_one(hardened) -> None:
    service, url = hardened
    heavy = sdk(url, "tml-heavy").create_sampling_client(base_model=BASE).result()
    light = sdk(url, "tml-light").create_sampling_client(base_model=BASE).result()
    prompt = tt.ModelInput.from_ints([7, 8, 9])
    big = heavy.sample(prompt, 64, tt.SamplingParams(max_tokens=16, seed=0, stop=[]))
    feeder = service.sampling._base_feeders[BASE]
    for _ in range(3000):  # the big request is queued before the small one comes
        if feeder.queued() > 0:
            break
        threading.Event().wait(0.01)
    small = light.sample(prompt, 1, tt.SamplingParams(max_tokens=4, seed=0, stop=[])).result()
    assert len(small.sequences[0].tokens) == 4
    assert feeder.queued() > 0  # FIFO would have run all 64 of the big request first
    assert len(big.result().sequences) == 64


# ---------------------------------------------------------------- 5. refusals and seq_ids


def test_refused_requests_consume_their_seq_id(hardened) -> None:
    _, url = hardened
    training = sdk(url).create_lora_training_client(BASE, rank=4).result()
    batch = data(3, n=2)
    before = training.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    with pytest.raises(Exception, match="path: 'bad/name' is not a valid name"):
        training.save_state("bad/name").result()
    missing = f"tinker://{training.model_id}/weights/nope"
    # load_state (deprecated in SDK 0.38) is the SDK's only load into this model's seq_ids
    with (
        pytest.warns(FutureWarning, match=r"TrainingClient\.load_state\*\(\) is deprecated"),
        pytest.raises(Exception, match="404|not found"),
    ):
        training.load_state(missing).result()
    # each refusal took its seq_id: the next operation runs at once instead of after a gap
    after = training.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    assert after == pytest.approx(before, abs=1e-6)


def test_a_body_that_fails_validation_consumes_its_seq_id_and_far_ids_are_refused(
    hardened,
) -> None:
    _, url = hardened
    wire = Wire(url)
    model = wire.new_model()
    bad = {"model_id": model, "seq_id": 1, "adam_params": {"learning_rate": "fast"}}
    r = wire.post("/optim_step", bad)
    assert r.status_code == 400 and "adam_params.learning_rate" in r.json()["detail"]
    r = wire.fwdbwd(model, 10**9, data(4))
    assert r.status_code == 400 and "seq_id: 1000000000 is more than" in r.json()["detail"]
    r = wire.fwdbwd(model, 0, data(4))
    assert r.status_code == 400 and "seq_id: expected an integer >= 1, got 0" in r.text
    out = wire.result(wire.fwdbwd(model, 2, data(4), forward_only=True).json())
    assert math.isfinite(losses(out))  # seq 1 was consumed by the refusal: no gap


# ---------------------------------------------------------------- 6. finite JSON


def test_a_vetoed_step_answers_finite_json_the_sdk_accepts(hardened) -> None:
    _, url = hardened
    training = sdk(url).create_lora_training_client(BASE, rank=4).result()
    batch = data(5, n=2)
    before = training.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    # in-range inputs whose ratio exp(lp + 700) overflows: the clipped ppo loss stays finite
    # (-1.2 a token), the gradient of the unclipped branch it takes is not
    overflowing = [
        tt.Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "logprobs": [-700.0] * len(d.loss_fn_inputs["target_tokens"].data),
                "advantages": [1.0] * len(d.loss_fn_inputs["target_tokens"].data),
            },
        )
        for d in batch
    ]
    training.forward_backward(overflowing, "ppo").result()  # gradients are NaN
    metrics = training.optim_step(tt.AdamParams(learning_rate=1e-2)).result().metrics
    assert metrics["skipped_nonfinite:sum"] == 1.0 and "grad_norm:mean" not in metrics
    after = training.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    assert after == before  # the veto left the weights alone


# ---------------------------------------------------------------- 7 and 9. small things


def test_seeds_past_64_bits_are_400_not_500(hardened) -> None:
    _, url = hardened
    wire = Wire(url)
    req0 = tt.CreateSessionRequest(tags=[], user_metadata=None, sdk_version="x")
    session = wire.post("/create_session", req0.model_dump(mode="json")).json()["session_id"]
    created = {"session_id": session, "sampling_session_seq_id": 0, "base_model": BASE}
    sampler = wire.post("/create_sampling_session", created).json()["sampling_session_id"]
    body = {
        "sampling_session_id": sampler,
        "seq_id": 1,
        "num_samples": 2,
        "prompt": tt.ModelInput.from_ints([7, 8]).model_dump(mode="json"),
        "sampling_params": {"max_tokens": 2, "seed": 2**64 - 1},
    }
    r = wire.post("/asample", body)
    assert r.status_code == 400 and "sampling_params.seed" in r.json()["detail"]
    r = wire.post("/asample", {**body, "sampling_params": {"max_tokens": 2, "seed": 2**70}})
    assert r.status_code == 400 and "seed" in r.text


def test_pages_cross_entropy_defaults_and_absolute_tokenizer_path(
    tmp_path, monkeypatch, one_thread
) -> None:
    monkeypatch.chdir(tmp_path)
    from furlong.server.app import create_app
    from furlong.server.service import Service, ServiceConfig
    from furlong.serving import background_server

    service = Service(ServiceConfig(base_models={BASE: BASE}, state_dir="relative-state"))
    with background_server(create_app(service)) as url:
        wire = Wire(url)
        for query, field in (("offset=-1", "offset"), ("limit=-5", "limit"), ("limit=0", "limit")):
            for path in ("/training_runs", "/checkpoints"):
                r = wire.http.get(f"{path}?{query}")
                assert r.status_code == 400 and r.json()["detail"].startswith(field), r.text
        training = sdk(url).create_lora_training_client(BASE, rank=4).result()
        info = wire.http.post(
            "/get_info", json={"model_id": training.model_id}, headers={"X-API-Key": "tml-hard"}
        ).json()
        assert info["model_data"]["tokenizer_id"].startswith(str(tmp_path))
        monkeypatch.chdir("/")  # a client elsewhere loads it
        assert training.get_tokenizer().encode("1 + 1") == service.pool.base(BASE)[1].encode(
            "1 + 1"
        )
        tokens = [5, 17, 300, 42, 9]
        bare = tt.Datum(
            model_input=tt.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:]},
        )
        ones = tt.Datum(
            model_input=tt.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 4},
        )
        got = training.forward([bare], "cross_entropy").result().metrics["loss:sum"]
        want = training.forward([ones], "cross_entropy").result().metrics["loss:sum"]
        assert got == want and got > 0
