"""``furlong serve --dtype bfloat16`` through the official SDK: the base model in bf16, LoRA
adapters and log-probs in fp32; forward equals an in-process bf16 engine, training lowers a
fixed batch's loss, a trained snapshot samples and scores like its trainer; a full fine-tune
steps fp32 masters."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from furlong.models import build_preset
from furlong.server.service import ServiceConfig
from furlong.train.engine import TrainingEngine
from furlong.types import AdamParams
from tests.server.test_models import make_pool
from tests.server.test_sdk import BASE, client, rl_data, serve, sft_datum
from tests.train.helpers import random_datums

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def server(tmp_path_factory, one_thread):
    with serve(tmp_path_factory.mktemp("bf16"), dtype="bfloat16") as url:
        yield url


def test_dtype_names_are_checked_before_anything_loads(tmp_path) -> None:
    with pytest.raises(Exception, match="dtype: 'half' is not one of"):
        ServiceConfig(base_models={BASE: "tiny-qwen3"}, state_dir=tmp_path, dtype="half")


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo"])
def test_forward_equals_an_in_process_bf16_engine(server, loss_fn: str) -> None:
    training = client(server).create_lora_training_client(BASE, rank=4).result()
    sdk_data, data = rl_data()
    out = training.forward(sdk_data, loss_fn).result()
    model, tokenizer = build_preset("tiny-qwen3", seed=0)
    direct = TrainingEngine(model.to(torch.bfloat16), tokenizer).forward(data, loss_fn)
    fp32 = TrainingEngine(*build_preset("tiny-qwen3", seed=0)).forward(data, loss_fn)
    gaps = []
    for got, want, full in zip(out.loss_fn_outputs, direct.outputs, fp32.outputs, strict=True):
        lp = torch.from_numpy(np.asarray(got["logprobs"].to_numpy()))
        torch.testing.assert_close(lp, want["logprobs"], atol=1e-5, rtol=0)
        gaps.append(float((lp - full["logprobs"]).abs().max()))
    assert max(gaps) > 0  # the server really ran in bf16


def test_lora_training_lowers_its_batch_loss_and_its_snapshot_samples(server) -> None:
    training = client(server).create_lora_training_client(BASE, rank=8).result()
    tokenizer = training.get_tokenizer()
    data = [sft_datum(tokenizer, f"What is {i} + 1?", f" {i + 1}<|im_end|>") for i in range(4)]
    losses = []
    for _ in range(6):
        fb = training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        losses.append(fb.metrics["loss:sum"])
    assert losses[-1] < 0.8 * losses[0]
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer("What is 2 + 1?")["input_ids"])
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=0)
    seq = sampler.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0]
    assert len(seq.tokens) == len(seq.logprobs) > 0
    assert all(lp <= 0 for lp in seq.logprobs)
    # the trainer scores the sampled tokens as the sampler did (bf16 both, fp32 log-probs)
    ids = prompt.to_ints() + seq.tokens
    n = len(prompt.to_ints())
    scored = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    trainer = training.forward([scored], "cross_entropy").result()
    lps = trainer.loss_fn_outputs[0]["logprobs"].to_numpy()[n - 1 :]
    np.testing.assert_allclose(lps, seq.logprobs, atol=2e-2)  # bf16 decode vs batched pass


def test_a_full_finetune_steps_fp32_masters_of_a_bf16_model(tmp_path) -> None:
    pool = make_pool(tmp_path, full_finetune=True, dtype=torch.bfloat16)
    model = pool.create("m", BASE, None)
    engine = model.engine
    assert isinstance(engine, TrainingEngine)
    assert {p.dtype for p in engine.masters.model_params} == {torch.bfloat16}
    assert {p.dtype for p in engine.params} == {torch.float32}
    data = random_datums([5, 8])
    first = model.forward_backward(data, "cross_entropy", None, False).metrics["loss:sum"]
    for _ in range(3):
        model.optim_step(AdamParams(learning_rate=1e-3))
        last = model.forward_backward(data, "cross_entropy", None, False).metrics["loss:sum"]
    assert last < first
    base = pool.base(BASE)[0]  # the served base is not what the fine-tune trains
    assert all(p.dtype == torch.bfloat16 for p in base.parameters())
    assert not any(p is q for p in base.parameters() for q in engine.masters.model_params)
