"""Checkpoint features of SDK 0.38 through the official `tinker` SDK against `furlong serve` on
127.0.0.1: HF exports with download URLs (`save_weights_external`), checkpoint TTLs, and
`copy_weights`.

Downloads go through `urllib.request` with no headers, as tinker-cookbook's
`weights.download` does (test_cookbook_download.py runs the cookbook itself). Expiry is driven
by an injected server clock, never by waiting.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from peft import PeftModel
from tinker import types
from transformers import AutoModelForCausalLM

from furlong.models import build_preset
from furlong.server import external_weights
from furlong.server.models import SNAPSHOT_META
from tests.server.test_models import ADAM, make_pool
from tests.server.test_sdk import BASE, client, rl_data, serve
from tests.train.helpers import random_datums

os.environ.setdefault("TINKER_TELEMETRY", "0")
pytestmark = pytest.mark.usefixtures("one_thread")
HOUR = 3600


class Clock:
    """The server's wall clock, moved by hand."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def assert_serves_like(training: tinker.TrainingClient, adapter_dir: Path) -> None:
    """The adapter at `adapter_dir`, with peft on the served base, computes the server's
    log-probs for the trained model."""
    sdk_data, data = rl_data(3)
    served = training.forward(sdk_data, "cross_entropy").result().loss_fn_outputs
    base, _ = build_preset("tiny-qwen3", seed=0)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    for got, datum in zip(served, data, strict=True):
        with torch.no_grad():
            logits = model(datum.model_input[None]).logits[0]
        targets = datum.loss_fn_inputs["target_tokens"]
        want = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None])[:, 0]
        lp = torch.from_numpy(np.asarray(got["logprobs"].to_numpy()))
        torch.testing.assert_close(lp, want, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def clock() -> Clock:
    return Clock()


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("srv")


@pytest.fixture(scope="module")
def server(state_dir, clock, one_thread):
    # no background sweep during the module: expiry is checked on access, deterministically
    with serve(state_dir, clock=clock, ttl_sweep_interval=1e9) as url:
        yield url


def rest(url: str, key: str = "tml-test") -> tinker.RestClient:
    return tinker.RestClient(base_url=url, api_key=key)


def trained(url: str, key: str = "tml-test") -> tinker.TrainingClient:
    """A LoRA model one step away from its base (peft starts B at 0)."""
    training = client(url, key).create_lora_training_client(BASE, rank=4).result()
    training.forward_backward(rl_data(2)[0], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return training


def fetch(url: str, headers: dict[str, str] | None = None) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {})) as response:
        return response.read()


def status_of(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        fetch(url, headers)
    except urllib.error.HTTPError as exc:
        return exc.code
    return 200


def listed(url: str, run_id: str, key: str = "tml-test") -> dict[str, types.Checkpoint]:
    return {
        c.checkpoint_id: c for c in rest(url, key).list_checkpoints(run_id).result().checkpoints
    }


# ---------------------------------------------------------------- external weights


def test_external_weights_download_as_a_peft_adapter(server, tmp_path) -> None:
    training = trained(server)
    path = training.save_weights_external("final").result().path
    assert path == f"tinker://{training.model_id}/external_weights/final"
    response = rest(server).get_external_weights_urls(path).result()
    assert sorted(response.urls) == ["adapter_config.json", "adapter_model.safetensors"]
    assert response.expires > datetime.now(UTC)
    out = tmp_path / "adapter"
    out.mkdir()
    for name, url in response.urls.items():
        assert url.startswith(f"{server}/api/v1/")  # this server, plain http
        (out / name).write_bytes(fetch(url))  # no headers, like the cookbook's urlretrieve
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == BASE

    assert_serves_like(training, out)  # the downloaded adapter computes what the server does

    checkpoint = listed(server, training.model_id)["external_weights/final"]
    assert checkpoint.checkpoint_type == "external" and checkpoint.expires_at is None
    assert checkpoint.size_bytes == sum(f.stat().st_size for f in out.iterdir())


def test_download_urls_are_owner_scoped_and_tamper_proof(server) -> None:
    training = trained(server, "tml-alice")
    path = training.save_weights_external("mine").result().path
    urls = rest(server, "tml-alice").get_external_weights_urls(path).result().urls
    config_url, weights_url = urls["adapter_config.json"], urls["adapter_model.safetensors"]
    token = config_url.partition("?token=")[2]
    bare = config_url.partition("?")[0]
    assert status_of(config_url) == 200
    forged = token[:-1] + ("1" if token.endswith("0") else "0")
    assert status_of(f"{bare}?token={forged}") == 401
    assert status_of(f"{weights_url.partition('?')[0]}?token={token}") == 401  # another file
    assert status_of(bare) == 401  # neither a token nor a key
    assert status_of(bare, {"X-API-Key": "tml-alice"}) == 200  # the owner's key instead
    assert status_of(bare, {"X-API-Key": "tml-bob"}) == 404
    with pytest.raises(Exception, match="404|not found"):
        rest(server, "tml-bob").get_external_weights_urls(path).result()
    with pytest.raises(ValueError, match="external weights"):  # the SDK checks the segment
        rest(server, "tml-alice").get_external_weights_urls(path.replace("external_", ""))
    # a deleted export serves nothing, even with URLs signed before
    rest(server, "tml-alice").delete_checkpoint_from_tinker_path(path).result()
    assert status_of(config_url) == 404


def test_download_urls_expire(server, clock) -> None:
    training = trained(server, "tml-late")
    path = training.save_weights_external("x").result().path
    url = (
        rest(server, "tml-late")
        .get_external_weights_urls(path)
        .result()
        .urls["adapter_config.json"]
    )
    clock.now += external_weights.URL_LIFETIME
    try:
        assert status_of(url) == 401
        again = rest(server, "tml-late").get_external_weights_urls(path).result()
        assert status_of(again.urls["adapter_config.json"]) == 200
    finally:
        clock.now -= external_weights.URL_LIFETIME


def test_refused_export_options_leave_the_client_usable(server) -> None:
    training = trained(server)
    with pytest.raises(Exception, match=r"age_encryption_recipients\[0\]: 'age1xyz' is not a"):
        training.save_weights_external("enc", age_encryption_recipients=["age1xyz"]).result()
    with pytest.raises(Exception, match="path: '../x' is not a valid name"):
        training.save_weights_external("../x").result()
    with pytest.raises(Exception, match="path: .* is an HF export; load a weights/ path"):
        hf = training.save_weights_external("hf").result().path
        client(server).create_training_client_from_state(hf).result()
    assert training.save_state("after").result().path.endswith("/weights/after")


def test_full_finetune_exports_an_hf_model_dir(tmp_path) -> None:
    pool = make_pool(tmp_path, full_finetune=True)
    model = pool.create("s:train:0", BASE, None)
    model.forward_backward(random_datums([5, 8]), "cross_entropy", None, False)
    model.optim_step(ADAM)
    out = tmp_path / "export"
    size = external_weights.export(model, out)
    assert not (out / SNAPSHOT_META).exists() and "config.json" in external_weights.files(out)
    assert size == sum(f.stat().st_size for f in out.iterdir())
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    trained_weights = model.engine.model.state_dict()
    assert loaded.keys() == trained_weights.keys()
    for name, tensor in trained_weights.items():
        torch.testing.assert_close(loaded[name], tensor, atol=0, rtol=0)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dirs


# ---------------------------------------------------------------- TTL


def test_ttl_is_listed_set_removed_and_bounded(server, clock) -> None:
    training = trained(server)
    keep = training.save_state("keep").result().path
    training.save_state("short", ttl_seconds=HOUR).result()
    saved_at = clock.now
    with pytest.raises(Exception, match="ttl_seconds: must be between 3600 .* got 5"):
        training.save_weights_for_sampler("bad", ttl_seconds=5).result()
    checkpoints = listed(server, training.model_id)
    assert checkpoints["weights/keep"].expires_at is None
    assert checkpoints["weights/short"].expires_at.timestamp() == int(saved_at + HOUR)
    rest(server).set_checkpoint_ttl_from_tinker_path(keep, 2 * HOUR).result()
    expires = listed(server, training.model_id)["weights/keep"].expires_at
    assert expires.timestamp() == int(clock.now + 2 * HOUR)
    rest(server).set_checkpoint_ttl_from_tinker_path(keep, None).result()
    assert listed(server, training.model_id)["weights/keep"].expires_at is None
    with pytest.raises(Exception, match="ttl_seconds: must be between"):
        rest(server).set_checkpoint_ttl_from_tinker_path(keep, 10).result()
    with pytest.raises(Exception, match="404|not found"):
        rest(server, "tml-bob").set_checkpoint_ttl_from_tinker_path(keep, HOUR).result()


def test_expired_checkpoints_vanish_and_are_deleted(server, clock, state_dir) -> None:
    training = trained(server)
    run = state_dir / "state" / "runs" / training.model_id
    short = training.save_state("short", ttl_seconds=HOUR).result().path
    snap = training.save_weights_for_sampler("snap", ttl_seconds=HOUR).result().path
    training.save_state("long", ttl_seconds=3 * HOUR).result()
    clock.now += HOUR
    # past its expiry a checkpoint can be neither loaded nor sampled, swept or not yet
    with pytest.raises(Exception, match="404|not found"):
        client(server).create_training_client_from_state(short).result()
    with pytest.raises(Exception, match="404|not found"):
        client(server).create_sampling_client(model_path=snap).result()
    assert (run / "weights" / "short").is_dir()  # not swept yet (no background sweep here)
    assert sorted(listed(server, training.model_id)) == ["weights/long"]
    assert not (run / "weights" / "short").exists()  # the listing swept its run
    assert not (run / "sampler_weights" / "snap").exists()
    assert [p.name for p in run.rglob(".*")] == [".long.expires"]
    # re-saving an expired name starts afresh, with the new save's expiry
    clock.now += 2 * HOUR
    training.save_state("long").result()
    assert listed(server, training.model_id)["weights/long"].expires_at is None


def test_expiry_survives_a_restart(tmp_path) -> None:
    clock = Clock()
    with serve(tmp_path, clock=clock) as url:
        training = trained(url)
        path = training.save_weights_external("export", ttl_seconds=HOUR).result().path
        training.save_state("kept").result()
    export = tmp_path / "state" / "runs" / training.model_id / "external_weights" / "export"
    assert export.is_dir() and (export.parent / ".export.expires").is_file()
    clock.now += HOUR
    with serve(tmp_path, clock=clock) as url:  # the start-up sweep, before any request
        assert not export.exists() and not (export.parent / ".export.expires").exists()
        assert sorted(listed(url, training.model_id)) == ["weights/kept"]
        with pytest.raises(Exception, match="404|not found"):
            rest(url).get_external_weights_urls(path).result()


# ---------------------------------------------------------------- copy_weights


def test_copy_weights_into_a_new_run(server, monkeypatch) -> None:
    training = trained(server, "tml-alice")
    source = training.save_state("step1").result().path
    copied = rest(server, "tml-alice").copy_weights(source, "proj-a", ttl_seconds=HOUR).result()
    run_id, segment, name = copied.removeprefix("tinker://").split("/")
    assert run_id != training.model_id and (segment, name) == ("weights", "step1")
    assert listed(server, run_id, "tml-alice")["weights/step1"].expires_at is not None
    assert listed(server, training.model_id, "tml-alice")["weights/step1"].expires_at is None
    # the copy outlives its source and loads the same weights
    sdk_data, _ = rl_data(2)
    want = training.forward(sdk_data, "cross_entropy").result().metrics["loss:sum"]
    rest(server, "tml-alice").delete_checkpoint_from_tinker_path(source).result()
    restored = client(server, "tml-alice").create_training_client_from_state(copied).result()
    got = restored.forward(sdk_data, "cross_entropy").result().metrics["loss:sum"]
    assert got == pytest.approx(want, abs=1e-6)
    info = rest(server, "tml-alice").get_training_run_by_tinker_path(copied).result()
    assert info.base_model == BASE and info.is_lora and info.lora_rank == 4
    # ServiceClient.copy_weights: the client's project, a fresh run each time
    monkeypatch.setenv("TINKER_PROJECT_ID", "proj-b")
    again = client(server, "tml-alice").copy_weights(copied).result()
    assert again.split("/")[2] != run_id and again.endswith("/weights/step1")
    with pytest.raises(Exception, match="404|not found"):  # another tenant's source
        rest(server, "tml-bob").copy_weights(copied, "proj-b").result()


def test_copy_weights_retries_and_session_slots(server) -> None:
    training = trained(server, "tml-carol")
    source = training.save_weights_for_sampler("snap").result().path
    session = training.model_id.split(":train:")[0]
    headers = {"X-API-Key": "tml-carol", "X-Idempotency-Key": "k1"}
    body = {"source_path": source, "session_id": session, "model_seq_id": 7}

    def post(body: dict, headers: dict) -> httpx.Response:
        return httpx.post(f"{server}/api/v1/copy_weights", json=body, headers=headers)

    first = post(body, headers)
    assert first.json() == {"tinker_path": f"tinker://{session}:train:7/sampler_weights/snap"}
    assert post(body, headers).json() == first.json()  # a retry: the same copy
    taken = post(body, headers | {"X-Idempotency-Key": "k2"})
    assert taken.status_code == 400 and "model_seq_id" in taken.json()["detail"]
    own = post(body | {"model_seq_id": 0}, headers | {"X-Idempotency-Key": "k3"})
    assert own.status_code == 400 and "already exists" in own.json()["detail"]
    by_project = {"source_path": source, "destination_project_id": "p"}
    a, b = post(by_project, headers), post(by_project, headers)
    assert a.json() == b.json() and a.json() != first.json()  # idempotent per key
    foreign = post(by_project, {"X-API-Key": "tml-dave", "X-Idempotency-Key": "k1"})
    assert foreign.status_code == 404
    # the copied snapshot samples
    copy = first.json()["tinker_path"]
    sampler = client(server, "tml-carol").create_sampling_client(model_path=copy).result()
    out = sampler.sample(
        types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2)
    )
    assert len(out.result().sequences[0].tokens) == 2
