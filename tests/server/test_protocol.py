"""The wire protocol below the SDK: out-of-order arrival, retried ``seq_id``s, gaps, size
limits and zstd bodies, driven with raw HTTP against a real server on 127.0.0.1."""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from tinker import types as tt
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from furlong.server.app import create_app
from furlong.server.proto import PROTOBUF
from furlong.server.service import Service, ServiceConfig
from furlong.serving import background_server

os.environ.setdefault("TINKER_TELEMETRY", "0")
pytestmark = pytest.mark.usefixtures("one_thread")
BASE = "tiny-qwen3"
KEY = {"X-API-Key": "tml-wire"}


def serve(tmp_path, app_kwargs=None, **overrides):
    config = ServiceConfig(base_models={BASE: BASE}, state_dir=tmp_path / "state", **overrides)
    service = Service(config)
    return service, background_server(create_app(service, **(app_kwargs or {})))


class Wire:
    """A minimal raw-HTTP Tinker client: just enough to send requests in any order."""

    def __init__(self, url: str):
        self.http = httpx.Client(base_url=url + "/api/v1", headers=KEY, timeout=60)

    def post(self, path: str, body: dict) -> httpx.Response:
        return self.http.post(path, json=body)

    def new_model(self, rank: int = 4) -> str:
        req0 = tt.CreateSessionRequest(tags=[], user_metadata=None, sdk_version="x")
        session = self.post("/create_session", req0.model_dump(mode="json")).json()
        req = tt.CreateModelRequest(
            session_id=session["session_id"],
            model_seq_id=0,
            base_model=BASE,
            lora_config=tt.LoraConfig(rank=rank, seed=7),  # same init for every model
        )
        out = self.result(self.post("/create_model", req.model_dump(mode="json")).json())
        return out["model_id"]

    def fwdbwd_body(self, model_id: str, seq_id: int, data, forward_only=False) -> bytes:
        request = tt.ForwardBackwardRequest(
            forward_backward_input=tt.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
            model_id=model_id,
            seq_id=seq_id,
        )
        msg = forward_backward_request_to_proto(request)
        msg.forward_only = forward_only
        return msg.SerializeToString()

    def fwdbwd(self, model_id: str, seq_id: int, data, forward_only=False) -> httpx.Response:
        body = self.fwdbwd_body(model_id, seq_id, data, forward_only)
        return self.http.post("/forward_backward", content=body, headers={"Content-Type": PROTOBUF})

    def optim(self, model_id: str, seq_id: int, lr: float = 1e-2) -> httpx.Response:
        req = tt.OptimStepRequest(
            optim_params=tt.AdamParams(learning_rate=lr), model_id=model_id, seq_id=seq_id
        )
        return self.post("/optim_step", req.model_dump(mode="json"))

    def result(self, submitted: dict):
        while True:
            r = self.post("/retrieve_future", {"request_id": submitted["request_id"]})
            assert r.status_code == 200, r.text
            if r.headers["content-type"].startswith(PROTOBUF):
                return deserialize_forward_backward_output(r.content)
            body = r.json()
            if body.get("type") != "try_again":
                return body


def data(seed: int = 0, n: int = 3) -> list[tt.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        tokens = rng.integers(3, 700, size=7 + 2 * i).tolist()
        out.append(
            tt.Datum(
                model_input=tt.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
            )
        )
    return out


def losses(out) -> float:
    return out.metrics["loss:sum"]


@pytest.fixture(scope="module")
def wire(tmp_path_factory, one_thread):
    _, server = serve(tmp_path_factory.mktemp("wire"), gap_timeout=2.0)
    with server as url:
        yield Wire(url)


def test_out_of_order_arrival_runs_in_seq_order_and_retries_dedupe(wire) -> None:
    batch = data()
    # reference, in order: fwdbwd(1) → optim(2) → forward(3)
    ref = wire.new_model()
    for submitted in (wire.fwdbwd(ref, 1, batch), wire.optim(ref, 2)):
        wire.result(submitted.json())
    want = losses(wire.result(wire.fwdbwd(ref, 3, batch, forward_only=True).json()))

    model = wire.new_model()
    third = wire.fwdbwd(model, 3, batch, forward_only=True).json()
    second = wire.optim(model, 2).json()
    first = wire.fwdbwd(model, 1, batch).json()
    retried = wire.fwdbwd(model, 1, batch).json()  # a client retry of seq 1: same request
    assert retried["request_id"] == first["request_id"]
    assert wire.optim(model, 2).json()["request_id"] == second["request_id"]
    got = wire.result(third)
    assert losses(got) == pytest.approx(want, abs=1e-6)  # one step, gradients not doubled
    fresh = wire.new_model()
    untrained = losses(wire.result(wire.fwdbwd(fresh, 1, batch, forward_only=True).json()))
    assert want < untrained - 1e-3  # the step did move the model
    # results stay retrievable more than once
    assert losses(wire.result(first)) == losses(wire.result(first))


def test_a_gap_that_never_fills_fails_with_a_clear_error(wire) -> None:
    model = wire.new_model()
    waiting = wire.fwdbwd(model, 2, data(1), forward_only=True).json()  # seq 1 never comes
    out = wire.result(waiting)
    assert out["category"] == "user" and "seq_id" in out["error"], out


def test_bad_seq_ids_and_foreign_futures(wire) -> None:
    model = wire.new_model()
    r = wire.optim(model, 0)
    assert r.status_code == 400 and "seq_id" in r.json()["detail"]
    done = wire.fwdbwd(model, 1, data(2), forward_only=True).json()
    other = wire.http.post(
        "/retrieve_future",
        json={"request_id": done["request_id"]},
        headers={"X-API-Key": "tml-someone-else"},
    )
    assert other.status_code == 200 and "unknown request_id" in other.json()["error"]


def test_size_limits_are_413_and_400_and_change_nothing(tmp_path) -> None:
    _, server = serve(
        tmp_path, app_kwargs={"max_body_bytes": 4096}, max_datums=2, max_tokens_per_datum=20
    )
    with server as url:
        wire = Wire(url)
        model = wire.new_model()
        small = data(3, n=2)
        want = losses(wire.result(wire.fwdbwd(model, 1, small, forward_only=True).json()))
        big = data(4, n=1)[0]
        long_tokens = list(range(3, 3 + 30))
        big = tt.Datum(
            model_input=tt.ModelInput.from_ints(long_tokens[:-1]),
            loss_fn_inputs={"target_tokens": long_tokens[1:], "weights": [1.0] * 29},
        )
        r = wire.fwdbwd(model, 2, [big])
        assert r.status_code == 400 and "data[0].model_input: 29 tokens" in r.json()["detail"]
        r = wire.fwdbwd(model, 3, data(5, n=3))
        assert r.status_code == 400 and "data: 3 datums; the limit is 2" in r.json()["detail"]
        huge = wire.fwdbwd_body(model, 4, small) + b"\0" * 5000
        r = wire.http.post("/forward_backward", content=huge, headers={"Content-Type": PROTOBUF})
        assert r.status_code == 413 and "the limit is 4096" in r.json()["detail"]
        # a refusal consumed its seq_id: resent, it is refused again; another body is a conflict
        r = wire.fwdbwd(model, 2, [big])
        assert r.status_code == 400 and "29 tokens" in r.json()["detail"]
        assert wire.fwdbwd(model, 2, small).status_code == 409
        # nothing was applied, and the model's next operation runs at once (no seq_id gap)
        wire.result(wire.optim(model, 4, lr=1.0).json())
        again = losses(wire.result(wire.fwdbwd(model, 5, small, forward_only=True).json()))
        assert again == pytest.approx(want, abs=1e-6)


def test_zstd_bodies_from_the_sdk(tmp_path) -> None:
    service, server = serve(tmp_path, compress_fwdbwd=True)
    seen: list[str | None] = []
    original = service.decode_forward_backward

    def recording(body, encoding, max_bytes):
        seen.append(encoding)
        if encoding == "zstd":  # really compressed: it decompresses to a valid request
            zstandard.ZstdDecompressor().decompressobj().decompress(body)
        return original(body, encoding, max_bytes)

    service.decode_forward_backward = recording
    with server as url:
        client = tinker.ServiceClient(base_url=url, api_key="tml-zstd")
        training = client.create_lora_training_client(BASE, rank=4).result()
        batch = data(6)
        out = training.forward_backward(batch, "cross_entropy").result()
        plain = Wire(url)
        model = plain.new_model()
        ref = plain.result(plain.fwdbwd(model, 1, batch).json())
    assert seen and seen[0] == "zstd" and None in seen  # the SDK compressed; raw did not
    assert losses(out) == pytest.approx(losses(ref), abs=1e-6)
