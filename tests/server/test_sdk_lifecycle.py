"""Long runs through the official SDK hold bounded memory: a key holds at most its cap of models,
``unload_model`` and an ended session (finished, or silent past its timeout) free a model's
memory and its samplers while its checkpoints stay, and a standard RL loop (save a sampler,
sample, train, every step) does not grow."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import tinker
from tinker import types
from tinker._compat import model_dump
from tinker.lib.api_future_impl import _APIFuture
from tinker.lib.client_connection_pool_type import ClientConnectionPoolType

from furlong.server.app import create_app
from furlong.server.service import Service, ServiceConfig
from furlong.server.state import owner_id
from furlong.serving import background_server
from tests.server.test_sdk import BASE, client, rest, sft_datum

pytestmark = pytest.mark.usefixtures("one_thread")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def service_for(tmp_path, **overrides) -> Service:
    config = ServiceConfig(
        base_models={BASE: "tiny-qwen3"}, state_dir=tmp_path / "state", **overrides
    )
    return Service(config)


def on_loop(service: Service, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on the server's event loop (where sessions end), as its reaper does."""

    async def call() -> Any:
        return fn()

    assert service.futures.loop is not None
    return asyncio.run_coroutine_threadsafe(call(), service.futures.loop).result(60)


def unload(training: tinker.TrainingClient) -> types.UnloadModelResponse:
    """``unload_model`` with the SDK's own request and response types, HTTP client and future
    polling (SDK 0.38 ships the types but no public method)."""
    holder = training.holder

    async def go() -> types.UnloadModelResponse:
        request = types.UnloadModelRequest(model_id=training.model_id)
        with holder.aclient(ClientConnectionPoolType.TRAIN) as http:
            future = await http.post(
                "/api/v1/unload_model",
                body=model_dump(request, exclude_none=True, mode="json"),
                cast_to=types.UntypedAPIFuture,
            )
        return await _APIFuture(types.UnloadModelResponse, holder, future, time.time(), "Unload")

    return holder.run_coroutine_threadsafe(go()).result()


def wait_until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(600):  # bounded: the model's release runs on the compute lane
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def freed(service: Service, model_id: str) -> bool:
    gc.collect()
    return model_id not in service.pool._models


def adapters(service: Service) -> set[str]:
    return set(service.pool._bases[BASE].adapters)


def test_a_key_holds_at_most_its_cap_and_unloading_frees_a_slot(tmp_path) -> None:
    service = service_for(tmp_path, max_models_per_key=2)
    with background_server(create_app(service)) as url:
        alice = client(url, "tml-alice")
        first = alice.create_lora_training_client(BASE, rank=2).result()
        alice.create_lora_training_client(BASE, rank=2).result()
        with pytest.raises(Exception, match=r"already has 2 models loaded.*--max-models-per-key"):
            alice.create_lora_training_client(BASE, rank=2).result()
        client(url, "tml-bob").create_lora_training_client(BASE, rank=2).result()  # per key
        assert unload(first).model_id == first.model_id
        alice.create_lora_training_client(BASE, rank=2).result()  # the slot is free again
        assert len(service.training.loaded(owner_id("tml-alice"))) == 2


def test_unload_refuses_later_operations_frees_the_model_and_keeps_its_checkpoints(
    tmp_path,
) -> None:
    service = service_for(tmp_path)
    with background_server(create_app(service)) as url:
        sdk = client(url)
        training = sdk.create_lora_training_client(BASE, rank=4).result()
        tokenizer = training.get_tokenizer()
        datum = sft_datum(tokenizer, "What is 7 + 1?", " 8")
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        saved = training.save_state("kept").result().path
        model = service.training._runs[training.model_id].training_model
        engine = weakref.ref(model.engine)
        model = weakref.ref(model)
        assert len(adapters(service)) == 1
        unload(training)
        wait_until(lambda: freed(service, training.model_id), "the model left the pool")
        assert model() is None and engine() is None  # nothing holds its weights or optimizer
        assert adapters(service) == set()
        with pytest.raises(Exception, match="was unloaded"):
            training.forward([datum], "cross_entropy").result()
        restored = sdk.create_training_client_from_state(saved).result()
        before = training_loss(restored, datum)
        assert before > 0


def training_loss(training: tinker.TrainingClient, datum: types.Datum) -> float:
    return training.forward([datum], "cross_entropy").result().metrics["loss:sum"]


def test_a_silent_session_ends_freeing_its_models_and_samplers(tmp_path) -> None:
    service = service_for(tmp_path, session_timeout=60)
    clock = Clock()
    service.sessions.clock = clock
    with background_server(create_app(service)) as url:
        sdk = client(url)
        training = sdk.create_lora_training_client(BASE, rank=4).result()
        saved = training.save_state("kept").result().path
        sampler = training.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints([5, 6, 7])
        sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4)).result()
        assert service.sampling.snapshots.loaded()[0] == 1
        session_id = training.model_id.split(":train:")[0]
        own_snapshots = service.sampling.session_root / session_id
        assert own_snapshots.is_dir()
        other = client(url, "tml-other").create_lora_training_client(BASE, rank=4).result()

        def silence() -> int:  # both sessions go quiet; only one is heard from again
            clock.now += 61
            service.sessions.touch(other.model_id.split(":train:")[0])
            return service.reap()

        assert on_loop(service, silence) == 1
        wait_until(lambda: freed(service, training.model_id), "the silent model left the pool")
        assert other.model_id in service.pool._models
        assert service.sampling.snapshots.loaded()[0] == 0 and not own_snapshots.exists()
        assert session_id not in service.sessions.owned(owner_id("tml-test"))
        with pytest.raises(Exception, match="was unloaded"):
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        with pytest.raises(Exception, match="its session ended"):
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
        # the checkpoint outlives the session
        client(url).create_training_client_from_state(saved).result().save_state("again").result()


def test_finishing_a_session_ends_it_and_the_listing_shows_live_sessions(tmp_path) -> None:
    service = service_for(tmp_path)
    with background_server(create_app(service)) as url:
        sdk = client(url)
        training = sdk.create_lora_training_client(BASE, rank=2).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        session_id = training.model_id.split(":train:")[0]
        rest_client = rest(url)
        assert session_id in rest_client.list_sessions().result().sessions
        info = rest_client.get_session(session_id).result()
        assert info.training_run_ids == [training.model_id]
        assert info.sampler_ids == [sampler._sampling_session_id]
        other = rest(url, "tml-other")
        assert session_id not in other.list_sessions().result().sessions
        sdk.close("success").result()  # POST sessions/{id}/finish
        wait_until(lambda: freed(service, training.model_id), "the finished model left the pool")
        assert session_id not in rest(url).list_sessions().result().sessions


@pytest.mark.parametrize("cycles", [200])
def test_save_and_sample_cycles_do_not_grow(tmp_path, cycles: int) -> None:
    """The cookbook's RL step (save a sampler, sample, train) 200 times on one model: past the
    first 20 steps the process's RSS grows by at most 5%, and at most ``snapshot_engines``
    snapshot engines are loaded at any time."""
    service = service_for(tmp_path, snapshot_engines=4)
    with background_server(create_app(service)) as url:
        training = client(url).create_lora_training_client(BASE, rank=8).result()
        tokenizer = training.get_tokenizer()
        prompt = types.ModelInput.from_ints(tokenizer("What is 2 + 3?")["input_ids"])
        rss: list[float] = []
        for step in range(cycles):
            sampler = training.save_weights_and_get_sampling_client().result()
            result = sampler.sample(prompt, 4, types.SamplingParams(max_tokens=6)).result()
            data = [rl_datum(prompt.to_ints(), s) for s in result.sequences]
            training.forward_backward(data, "importance_sampling").result()
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            assert service.sampling.snapshots.loaded()[0] <= 4
            if step in (19, cycles - 1):
                gc.collect()
                rss.append(process_rss_mb())
        assert rss[1] <= 1.05 * rss[0], rss


def rl_datum(prompt: list[int], seq: types.SampledSequence) -> types.Datum:
    tokens = prompt + list(seq.tokens)
    n = len(tokens) - 1
    logprobs = [0.0] * (len(prompt) - 1) + list(seq.logprobs)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": logprobs,
            "advantages": [0.0] * (len(prompt) - 1) + [1.0] * (n - len(prompt) + 1),
        },
    )


def process_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_snapshot_engines_are_built_on_the_compute_lane_never_on_the_event_loop(
    tmp_path, monkeypatch
) -> None:
    """Both ways to sample a snapshot (a sampling client, and ``asample`` naming a
    ``model_path``) build its engine as the tenant's work unit on the compute lane."""
    from furlong.server import sampling

    built_on: list[str] = []
    real = sampling.sampling_model

    def recording(pool, path):
        built_on.append(threading.current_thread().name)
        return real(pool, path)

    monkeypatch.setattr(sampling, "sampling_model", recording)
    service = service_for(tmp_path)
    with background_server(create_app(service)) as url:
        sdk = client(url)
        training = sdk.create_lora_training_client(BASE, rank=2).result()
        prompt = types.ModelInput.from_ints([5, 6, 7])
        params = types.SamplingParams(max_tokens=3)
        training.save_weights_and_get_sampling_client().result().sample(prompt, 1, params).result()
        assert len(built_on) == 1
        path = training.save_weights_for_sampler("named").result().path
        # asample naming a model_path (what SDKs before sampling sessions sent): answered at
        # once with a request id, while the engine is built on the lane
        request = types.SampleRequest(
            num_samples=1, prompt=prompt, sampling_params=params, model_path=path
        )
        answer = httpx.post(
            f"{url}/api/v1/asample",
            json=model_dump(request, exclude_none=True, mode="json"),
            headers={"X-API-Key": "tml-test"},
        )
        assert answer.status_code == 200 and answer.json()["request_id"]
        wait_until(lambda: len(built_on) == 2, "the legacy request's build")
        assert all(name.startswith("furlong-train") for name in built_on), built_on


def test_a_session_whose_model_has_work_in_flight_is_not_silent(tmp_path) -> None:
    """A client waiting on a long operation may send nothing but polls: its session lives."""
    service = service_for(tmp_path, session_timeout=60)
    clock = Clock()
    service.sessions.clock = clock
    with background_server(create_app(service)) as url:
        training = client(url).create_lora_training_client(BASE, rank=2).result()
        # an operation queued behind a seq_id that has not arrived: the model is busy
        request = types.OptimStepRequest(
            model_id=training.model_id, seq_id=50, adam_params=types.AdamParams(learning_rate=1e-3)
        )
        sent = httpx.post(
            f"{url}/api/v1/optim_step",
            json=model_dump(request, exclude_none=True, mode="json"),
            headers={"X-API-Key": "tml-test"},
        )
        assert sent.status_code == 200

        def silence() -> int:
            clock.now += 61
            return service.reap()

        assert on_loop(service, silence) == 0
        assert training.model_id in service.pool._models
