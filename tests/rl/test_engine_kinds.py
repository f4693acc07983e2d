"""A new rollout engine kind is one file plus one registry line, and every front door uses
it when asked: the RL loop (``rollout.engine``), the session server (``--engine``) and the
Tinker service (``--rollout-engine``). The kind here, ``recording``, is the embedded engine
that keeps every prompt it is asked to continue (tests/rollout/recording_engine.py)."""

from __future__ import annotations

import json

import httpx
import pytest
from tinker import types

from furlong.errors import InputError
from furlong.rl.config import load_config
from furlong.rl.loop import train
from furlong.rollout.sessions import serve as session_serve
from furlong.server.config import ServiceConfig
from furlong.serving import background_server
from tests.rollout.recording_engine import registered
from tests.server.test_sdk import BASE, client, serve

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_loop_samples_from_the_kind_it_names(tmp_path, short_reward) -> None:
    kind = registered()
    before = len(kind.built)
    config = load_config(
        None,
        [
            "model.name=tiny-qwen3",
            "rollout.engine=recording",
            "task.reward=short_text",
            "task.eval_size=2",
            "task.eval_samples=0",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_tokens=3",
            "run.steps=2",
            "run.eval_every=2",
            "run.progress=false",
            "run.export_hf=false",
            f"run.out_dir={tmp_path}",
        ],
    )
    train(config)
    (engine,) = kind.built[before:]  # one engine for the run
    # two steps of 2 prompts x 2 samples, and the held-out set greedy before and after
    assert len(engine.prompts) == 2 * 2 * 2 + 2 * 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and engine.weight_version == 2  # each step was published to it


def test_the_session_server_serves_turns_from_the_kind_it_names() -> None:
    kind = registered()
    before = len(kind.built)
    app = session_serve.build("tiny-qwen3", "abort", engine="recording")
    (engine,) = kind.built[before:]
    with background_server(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        session = http.post("/sessions").json()
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "seed": 0}
        response = http.post(f"{session['base_url']}/chat/completions", json=body)
        assert response.status_code == 200, response.text
        (record,) = http.get(f"/sessions/{session['id']}").json()["records"]
    assert engine.prompts == [record["prompt_ids"]]


def test_the_tinker_service_samples_from_the_kind_it_names(tmp_path) -> None:
    kind = registered()
    before = len(kind.built)
    with serve(tmp_path, rollout_engine="recording") as url:
        training = client(url).create_lora_training_client(base_model=BASE, rank=4).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints([5, 6, 7])
        params = types.SamplingParams(max_tokens=3, seed=0)
        result = sampler.sample(prompt, 2, params).result()
    assert len(result.sequences) == 2
    base, snapshot = kind.built[before:]  # the base's (it checks requests), then the snapshot's
    assert snapshot.prompts == [[5, 6, 7], [5, 6, 7]] and base.prompts == []


def test_a_kind_is_checked_against_the_front_door_before_the_model_loads(tmp_path) -> None:
    with pytest.raises(InputError, match=r"rollout_engine: 'ray' cannot serve here"):
        ServiceConfig({BASE: "tiny-qwen3"}, tmp_path, rollout_engine="ray")
    with pytest.raises(InputError, match=r"--engine: 'ray' cannot serve here: RayRollout lacks"):
        session_serve.build("no-such-model", "abort", engine="ray")
    with pytest.raises(InputError, match=r"rollout\.engine: 'nope' is not one of"):
        load_config(None, ["rollout.engine=nope"]).validate()
    with pytest.raises(InputError, match=r"--rollout-url / --vllm-python: the vLLM engine needs"):
        ServiceConfig({BASE: "tiny-qwen3"}, tmp_path, rollout_engine="vllm")
    with pytest.raises(InputError, match=r'--pause-mode: "retract" has no vLLM counterpart'):
        session_serve.build(
            "no-such-model",
            "retract",
            engine="vllm",
            engine_options={"urls": ["http://127.0.0.1:1"]},
        )
