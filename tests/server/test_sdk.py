"""The official `tinker` SDK, unchanged, against `furlong serve` on 127.0.0.1 (tiny model).

The oracle is furlong's TrainingEngine called in process on an identical base model: a fresh
LoRA adapter starts equal to the base (peft initialises B = 0), so every objective's
forward through the service must equal the engine's direct result."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from furlong.models import build_preset
from furlong.server.app import create_app
from furlong.server.service import Service, ServiceConfig
from furlong.serving import background_server
from furlong.train.engine import TrainingEngine
from furlong.types import Datum

os.environ.setdefault("TINKER_TELEMETRY", "0")
pytestmark = pytest.mark.usefixtures("one_thread")
BASE = "Qwen/Qwen3-8B-Base"  # a familiar name, mapped to the tiny preset


def serve(tmp_path, **overrides):
    config = ServiceConfig(
        base_models={BASE: "tiny-qwen3", "tiny-qwen3": "tiny-qwen3"},
        state_dir=tmp_path / "state",
        **overrides,
    )
    return background_server(create_app(Service(config)))


@pytest.fixture(scope="module")
def server(tmp_path_factory, one_thread):
    with serve(tmp_path_factory.mktemp("srv"), fwdbwd_max_chunk_len=2) as url:
        yield url


def client(url: str, key: str = "tml-test") -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=url, api_key=key)


def rl_data(n: int = 5, seed: int = 0) -> tuple[list[types.Datum], list[Datum]]:
    """The same datums for the SDK and for the engine."""
    rng = np.random.default_rng(seed)
    sdk, ours = [], []
    for i in range(n):
        length = 6 + 3 * i
        tokens = rng.integers(3, 700, size=length + 1)
        inputs = {
            "target_tokens": tokens[1:].astype(np.int64),
            "weights": rng.uniform(0.5, 1.5, length).astype(np.float32),
            "logprobs": -rng.uniform(3, 9, length).astype(np.float32),
            "advantages": rng.normal(0, 1, length).astype(np.float32),
        }
        sdk.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                loss_fn_inputs={k: types.TensorData.from_numpy(v) for k, v in inputs.items()},
            )
        )
        ours.append(Datum(tokens[:-1], inputs))
    return sdk, ours


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"])
def test_forward_equals_the_engine(server, loss_fn: str) -> None:
    service = client(server)
    training = service.create_lora_training_client(BASE, rank=4).result()
    sdk_data, data = rl_data()
    out = training.forward(sdk_data, loss_fn).result()  # 5 datums in chunks of 2
    model, tokenizer = build_preset("tiny-qwen3", seed=0)
    direct = TrainingEngine(model, tokenizer).forward(data, loss_fn)
    assert len(out.loss_fn_outputs) == len(data)
    for got, want in zip(out.loss_fn_outputs, direct.outputs, strict=True):
        lp = torch.from_numpy(np.asarray(got["logprobs"].to_numpy()))
        torch.testing.assert_close(lp, want["logprobs"], atol=1e-5, rtol=0)
    assert out.metrics["loss:sum"] == pytest.approx(direct.metrics["loss:sum"], abs=1e-3)
