"""Sampling features of SDK 0.38 through the official SDK on 127.0.0.1 (tiny model):
``target_prompt_logprobs`` (dense and sparse CSR), ``topk_sample_logprobs`` and
``prompt_logprobs_last_n``, each against an independent computation (a float64 HF forward of
the same base model, or the trainer's forward for a trained LoRA snapshot), and the refusals
(bad targets, ``prompt_alt_tokens_k``, ``record_stability_info``) naming their field."""

from __future__ import annotations

import copy
import os

import httpx
import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto.response_conv import deserialize_sample_response
from tinker.types._pydantic_types.tensor_data import TensorData as WireTensorData

from furlong.models import build_preset
from furlong.rollout.sampling import csr_tensor
from furlong.server.proto import SampledSeq, encode_sample_response
from tests.server import test_sdk
from tests.server.test_sdk import BASE, client, sft_datum

os.environ.setdefault("TINKER_TELEMETRY", "0")
pytestmark = pytest.mark.usefixtures("one_thread")
server = test_sdk.server  # the same module-scoped server fixture, one per module
KEY = "tml-test"  # client()'s default key: raw requests act as the same tenant
VOCAB = 768  # tiny-qwen3
K = 3


@pytest.fixture(scope="module")
def base():
    """The served base model in float64 (the preset is seeded) and its tokenizer."""
    model, tokenizer = build_preset("tiny-qwen3", seed=0)
    return copy.deepcopy(model).double().eval(), tokenizer


def logp64(model: torch.nn.Module, tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """``[len(tokens) - 1, V]`` float64: row i is the distribution over token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].double()
    return torch.log_softmax(logits / temperature, dim=-1)


def targets(prompt: list[int], seed: int, keep: float) -> torch.Tensor:
    """int64 ``[len(prompt) - 1, K]`` of ids in the vocabulary, ``-1`` where a uniform draw
    exceeds ``keep``; row 0 and the last row always name one id each."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(len(prompt) - 1, K))
    ids[rng.uniform(size=ids.shape) > keep] = -1
    ids[0, 1], ids[-1, 2] = 5, prompt[-1]
    return torch.from_numpy(ids.astype(np.int64))


def prompt_ids(tokenizer, text: str = "What is 12 + 30? Think first, then answer.") -> list[int]:
    return tokenizer(text)["input_ids"]


# ---------------------------------------------------------------- target_prompt_logprobs


def test_dense_target_prompt_logprobs_equal_a_float64_forward(server, base) -> None:
    model, tokenizer = base
    ids = prompt_ids(tokenizer)
    want_ids = targets(ids, seed=0, keep=0.6)
    assert (want_ids == -1).any()
    sent = types.TensorData.from_torch(want_ids)
    assert sent.sparse_crow_indices is None
    sampler = client(server).create_sampling_client(base_model=BASE).result()
    out = sampler.sample(
        types.ModelInput.from_ints(ids),
        num_samples=2,  # computed once, for the request
        sampling_params=types.SamplingParams(max_tokens=2, seed=3),
        target_prompt_logprobs=sent,
    ).result()
    got = out.target_prompt_logprobs
    assert got.dtype == "float32" and got.shape == [len(ids) - 1, K]
    assert got.sparse_crow_indices is None  # dense in, dense out
    ref = logp64(model, ids).gather(-1, want_ids.clamp(min=0))
    want = torch.where(want_ids < 0, 0.0, ref)  # the SDK's value for a cell that asks nothing
    torch.testing.assert_close(got.to_torch().double(), want, atol=5e-6, rtol=0)
    assert (got.to_torch()[want_ids < 0] == 0).all()
    assert out.prompt_logprobs is None  # targets do not need include_prompt_logprobs


def test_sparse_target_prompt_logprobs_come_back_on_the_same_cells(server, base) -> None:
    model, tokenizer = base
    ids = prompt_ids(tokenizer)
    want_ids = targets(ids, seed=1, keep=0.15)
    sent = types.TensorData.from_torch_sparse(want_ids, pad_value=-1)
    assert sent.sparse_crow_indices is not None  # sparse enough to go as CSR
    sampler = client(server).create_sampling_client(base_model=BASE).result()
    n = len(ids)
    out = sampler.sample(
        types.ModelInput.from_ints(ids),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        prompt_logprobs_last_n=2,  # the SDK: does not affect target_prompt_logprobs
        target_prompt_logprobs=sent,
    ).result()
    got = out.target_prompt_logprobs
    assert got.shape == [n - 1, K] and got.dtype == "float32"
    assert got.sparse_crow_indices == sent.sparse_crow_indices
    assert got.sparse_col_indices == sent.sparse_col_indices
    logp = logp64(model, ids)
    rows, cols = (want_ids >= 0).nonzero(as_tuple=True)  # CSR order: row-major
    listed = torch.tensor(got.data, dtype=torch.float64)
    torch.testing.assert_close(listed, logp[rows, want_ids[rows, cols]], atol=5e-6, rtol=0)
    dense = got.to_torch()  # unlisted cells densify to 0.0, as in a dense answer
    assert (dense[want_ids < 0] == 0).all()
    # the last prompt token named in the last row is the one prompt_logprobs scores
    assert out.prompt_logprobs[: n - 2] == [None] * (n - 2)
    assert dense[-1, 2].item() == pytest.approx(out.prompt_logprobs[-1], abs=1e-6)


def test_target_prompt_logprobs_of_a_trained_lora_snapshot(server, base) -> None:
    model, tokenizer = base
    training = client(server).create_lora_training_client(BASE, rank=4, seed=3).result()
    datum = sft_datum(tokenizer, "What is 2 + 3?", " 5<|im_end|>")
    for _ in range(2):  # lora B moves away from 0: the snapshot differs from the base
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    ids = prompt_ids(tokenizer, "What is 2 + 3? 5")
    want_ids = targets(ids, seed=2, keep=0.7)
    out = sampler.sample(
        types.ModelInput.from_ints(ids),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=1),
        target_prompt_logprobs=types.TensorData.from_torch(want_ids),
    ).result()
    got = out.target_prompt_logprobs.to_torch()
    # the trainer's forward on the same weights: 2-D cross_entropy targets give [N, K] log-probs
    scored = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_torch(want_ids.clamp(min=0)),
            "weights": types.TensorData.from_torch(torch.ones(want_ids.shape)),
        },
    )
    fwd = training.forward([scored], "cross_entropy").result()
    trainer = fwd.loss_fn_outputs[0]["logprobs"].to_torch()
    want = torch.where(want_ids < 0, 0.0, trainer)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    base_lp = torch.where(want_ids < 0, 0.0, logp64(model, ids).gather(-1, want_ids.clamp(min=0)))
    assert (got.double() - base_lp).abs().max() > 1e-3  # really the trained adapter


def test_the_wire_answer_decodes_to_the_sdks_values() -> None:
    """NaN (a cell that asked nothing) goes out as 0.0, a -inf log-prob stays -inf, and a
    sparse answer keeps its cells."""
    seq = [SampledSeq(tokens=[4], logprobs=[-0.25], stop_reason="length")]
    dense = torch.tensor([[-1.5, torch.nan], [-torch.inf, -0.125]])
    got = deserialize_sample_response(encode_sample_response(seq, target_prompt=dense))
    td = got.target_prompt_logprobs
    assert td.dtype == "float32" and td.shape == [2, 2] and td.sparse_crow_indices is None
    assert td.to_torch().tolist() == [[-1.5, 0.0], [-torch.inf, -0.125]]
    crow, col = torch.tensor([0, 1, 1, 3]), torch.tensor([2, 0, 1])
    sparse = csr_tensor(crow, col, torch.tensor([-2.5, torch.nan, -0.75]), (3, 3))
    td = deserialize_sample_response(encode_sample_response(seq, target_prompt=sparse))
    td = td.target_prompt_logprobs
    assert td.sparse_crow_indices == [0, 1, 1, 3] and td.sparse_col_indices == [2, 0, 1]
    assert td.data == [-2.5, 0.0, -0.75]
    assert td.to_torch().tolist() == [[0.0, 0.0, -2.5], [0.0, 0.0, 0.0], [0.0, -0.75, 0.0]]


def raw_sample(url: str, sampler_id: str, prompt: list[int], **fields) -> httpx.Response:
    """What the SDK would send, minus its client-side checks."""
    req = types.SampleRequest(
        sampling_session_id=sampler_id,
        prompt=types.ModelInput.from_ints(prompt),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=1),
        **fields,
    )
    body = req.model_dump(mode="json", exclude_none=True)
    return httpx.post(f"{url}/api/v1/asample", json=body, headers={"X-API-Key": KEY}, timeout=60)


def test_bad_target_prompt_logprobs_are_refused_naming_the_cell(server, base) -> None:
    _, tokenizer = base
    ids = prompt_ids(tokenizer)
    rows = len(ids) - 1
    sampler = client(server).create_sampling_client(base_model=BASE).result()
    prompt, params = types.ModelInput.from_ints(ids), types.SamplingParams(max_tokens=1)

    def refused(ids_tensor: torch.Tensor, match: str, sparse: bool = False) -> None:
        td = (
            types.TensorData.from_torch_sparse(ids_tensor, pad_value=-1)
            if sparse
            else types.TensorData.from_torch(ids_tensor)
        )
        assert (td.sparse_crow_indices is not None) == sparse
        with pytest.raises(Exception, match=match):
            sampler.sample(prompt, 1, params, target_prompt_logprobs=td).result()

    none = torch.full((rows, K), -1, dtype=torch.int64)
    refused(none[:-1].clone().fill_(1), r"target_prompt_logprobs: shape .* rows; .* needs")
    refused(torch.ones(rows, 65, dtype=torch.int64), r"target_prompt_logprobs: K = 65 .*\[1, 64\]")
    out_of_vocab = none.clone().fill_(1)
    out_of_vocab[2, 1] = VOCAB
    refused(out_of_vocab, rf"target_prompt_logprobs\[2, 1\]: token id {VOCAB} outside")
    below = none.clone().fill_(1)
    below[0, 2] = -5
    refused(below, r"target_prompt_logprobs\[0, 2\]: token id -5")
    refused(none, r"target_prompt_logprobs: names no token id")
    sparse_bad = none.clone()
    sparse_bad[1, 0], sparse_bad[4, 2] = 3, VOCAB + 9
    refused(sparse_bad, r"target_prompt_logprobs\[4, 2\]: token id 777 outside", sparse=True)

    # the SDK refuses these client-side; the server refuses them too
    sampler_id = sampler._sampling_session_id
    floats = WireTensorData(data=[1.0] * rows * K, dtype="float32", shape=[rows, K])
    flat = WireTensorData(data=[1] * rows, dtype="int64", shape=[rows])
    bad_csr = WireTensorData(
        data=[1, 2],
        dtype="int64",
        shape=[rows, K],
        sparse_crow_indices=[0, 2] + [2] * (rows - 1),
        sparse_col_indices=[1, 1],
    )
    for td, match in [
        (floats, "target_prompt_logprobs: must be an int64 tensor"),
        (flat, r"target_prompt_logprobs: must be 2-D"),
        (bad_csr, "target_prompt_logprobs.sparse_col_indices: must be strictly increasing"),
    ]:
        r = raw_sample(server, sampler_id, ids, target_prompt_logprobs=td)
        assert r.status_code == 400 and match in r.json()["detail"], r.text
    # nothing was queued by the refusals: the sampler samples on
    assert len(sampler.sample(prompt, 1, params).result().sequences[0].tokens) == 1


# ---------------------------------------------------------------- topk_sample_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_sample_logprobs_equal_a_float64_rescoring(server, base, temperature) -> None:
    """The top-k of every sampled position is that of the distribution sampled from (the
    request's temperature; no top-k / top-p here), sorted, and holds the sampled token."""
    model, tokenizer = base
    ids = prompt_ids(tokenizer)
    sampler = client(server).create_sampling_client(base_model=BASE).result()
    params = types.SamplingParams(max_tokens=6, seed=11, temperature=temperature, stop=[])
    out = sampler.sample(
        types.ModelInput.from_ints(ids), 2, params, topk_sample_logprobs=4
    ).result()
    for seq in out.sequences:
        tokens = ids + seq.tokens
        logp = logp64(model, tokens, temperature)[len(ids) - 1 :]  # the sampled positions
        want_v, want_i = torch.topk(logp, 4)
        assert len(seq.topk_logprobs) == len(seq.tokens) == 6
        got_i = torch.tensor([[t for t, _ in row] for row in seq.topk_logprobs])
        got_v = torch.tensor(
            [[v for _, v in row] for row in seq.topk_logprobs], dtype=torch.float64
        )
        assert torch.equal(got_i, want_i)
        torch.testing.assert_close(got_v, want_v, atol=5e-6, rtol=0)
        assert (got_v[:, :-1] >= got_v[:, 1:]).all()  # sorted, best first
        chosen = torch.tensor(seq.logprobs, dtype=torch.float64)
        sampled = logp.gather(-1, torch.tensor(seq.tokens)[:, None])[:, 0]
        torch.testing.assert_close(chosen, sampled, atol=5e-6, rtol=0)
        assert (got_v[:, 0] >= chosen - 1e-6).all()


# ---------------------------------------------------------------- prompt_logprobs_last_n


def test_prompt_logprobs_last_n_blanks_the_head_of_both_prompt_fields(server, base) -> None:
    model, tokenizer = base
    ids = prompt_ids(tokenizer)
    n, last_n = len(ids), 5
    sampler = client(server).create_sampling_client(base_model=BASE).result()
    prompt, params = types.ModelInput.from_ints(ids), types.SamplingParams(max_tokens=1, seed=2)
    full = sampler.sample(
        prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=3
    ).result()
    tail = sampler.sample(
        prompt,
        1,
        params,
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
        prompt_logprobs_last_n=last_n,
    ).result()
    assert tail.prompt_logprobs[: n - last_n] == [None] * (n - last_n)
    assert tail.topk_prompt_logprobs[: n - last_n] == [None] * (n - last_n)
    assert tail.prompt_logprobs[-last_n:] == full.prompt_logprobs[-last_n:]
    assert tail.topk_prompt_logprobs[-last_n:] == full.topk_prompt_logprobs[-last_n:]
    logp = logp64(model, ids)[-last_n:]
    want = logp.gather(-1, torch.tensor(ids[-last_n:])[:, None])[:, 0]
    got = torch.tensor(tail.prompt_logprobs[-last_n:], dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=5e-6, rtol=0)
    top_v, top_i = torch.topk(logp, 3)
    assert [[t for t, _ in row] for row in tail.topk_prompt_logprobs[-last_n:]] == top_i.tolist()
    # out of range: [1, len(prompt) - 1]; the SDK checks only >= 1, the server the rest
    with pytest.raises(Exception, match=r"prompt_logprobs_last_n: must be in \[1, "):
        sampler.sample(
            prompt, 1, params, include_prompt_logprobs=True, prompt_logprobs_last_n=n
        ).result()
    sampler_id = sampler._sampling_session_id
    for fields, match in [
        (dict(prompt_logprobs=True, prompt_logprobs_last_n=0), r"must be in \[1, "),
        (dict(prompt_logprobs_last_n=2), "requires prompt_logprobs"),
    ]:
        r = raw_sample(server, sampler_id, ids, **fields)
        assert r.status_code == 400, r.text
        assert r.json()["detail"].startswith("prompt_logprobs_last_n: "), r.text
        assert match.replace("\\", "") in r.json()["detail"]


# ---------------------------------------------------------------- refused features


def test_prompt_alt_tokens_and_stability_info_are_refused_by_name(server) -> None:
    service = client(server)
    prompt, params = types.ModelInput.from_ints([5, 17, 42, 99]), types.SamplingParams(max_tokens=1)
    sampler = service.create_sampling_client(base_model=BASE).result()
    with pytest.raises(Exception, match="prompt_alt_tokens_k: not supported by furlong"):
        sampler.sample(prompt, 1, params, prompt_alt_tokens_k=2).result()
    recording = service.create_sampling_client(base_model=BASE, record_stability_info=True)
    with pytest.raises(Exception, match="record_stability_info: not supported by furlong"):
        recording.result().sample(prompt, 1, params).result()
