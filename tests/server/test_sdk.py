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
from transformers import AutoTokenizer

from furlong.models import build_preset
from furlong.server.app import create_app
from furlong.server.service import Service, ServiceConfig
from furlong.serving import background_server
from furlong.train.engine import TrainingEngine
from furlong.types import Datum
from tests.server.cli_server import cli_server

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


def rest(url: str, key: str = "tml-test") -> tinker.RestClient:
    """The SDK's session-less client (listings, capabilities): SDK 0.38 deprecates
    ``ServiceClient.create_rest_client()`` for this."""
    return tinker.RestClient(base_url=url, api_key=key)


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


def sft_datum(tokenizer, prompt: str, answer: str) -> types.Datum:
    p, a = tokenizer(prompt)["input_ids"], tokenizer(answer)["input_ids"]
    tokens = p + a
    weights = [0.0] * (len(p) - 1) + [1.0] * len(a)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def test_training_moves_the_model_and_state_round_trips(server) -> None:
    service = client(server)
    training = service.create_lora_training_client(BASE, rank=8, seed=0).result()
    tokenizer = training.get_tokenizer()  # a local directory the client loads offline
    data = [sft_datum(tokenizer, f"What is {i} + 1?", f" {i + 1}<|im_end|>") for i in range(4)]
    adam = types.AdamParams(learning_rate=5e-3)
    losses = []
    for _ in range(6):
        fb = training.forward_backward(data, "cross_entropy").result()
        training.optim_step(adam).result()
        losses.append(fb.metrics["loss:sum"])
    assert losses[-1] < 0.8 * losses[0]

    saved = training.save_state("step6").result().path
    assert saved == f"tinker://{training.model_id}/weights/step6"
    restored = service.create_training_client_from_state_with_optimizer(saved).result()
    a = training.forward(data, "cross_entropy").result()
    b = restored.forward(data, "cross_entropy").result()
    assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], abs=1e-6)
    # identical next step with the restored optimizer state
    for t in (training, restored):
        t.forward_backward(data, "cross_entropy").result()
        t.optim_step(adam).result()
    a = training.forward(data, "cross_entropy").result()
    b = restored.forward(data, "cross_entropy").result()
    assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], abs=1e-5)
    runs = rest(server).list_training_runs().result()
    assert training.model_id in [r.training_run_id for r in runs.training_runs]


def test_forward_backward_custom(server) -> None:
    service = client(server)
    training = service.create_lora_training_client(BASE, rank=4, seed=0).result()
    sdk_data, _ = rl_data(3)

    def loss_fn(data, logprobs):  # maximise the mean log-prob of the targets
        loss = -sum(lp.sum() for lp in logprobs) / sum(len(lp) for lp in logprobs)
        return loss, {"custom:mean": float(loss.detach())}

    out = training.forward_backward_custom(sdk_data, loss_fn).result()
    assert out.metrics["loss:sum"] < 0 or out.metrics["loss:sum"] > 0
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = training.forward_backward_custom(sdk_data, loss_fn).result()
    assert after.metrics["loss:sum"] < out.metrics["loss:sum"]


def test_sampling_and_compute_logprobs(server) -> None:
    service = client(server)
    training = service.create_lora_training_client(BASE, rank=4).result()
    tokenizer = training.get_tokenizer()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer("What is 2 + 3?")["input_ids"])
    params = types.SamplingParams(max_tokens=8, seed=3, temperature=1.0, stop=[])
    a = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    b = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    for seq in a.sequences:
        assert len(seq.tokens) == 8 and len(seq.logprobs) == 8 and seq.stop_reason == "length"
    tokens = prompt.to_ints() + a.sequences[0].tokens
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert lps[0] is None and len(lps) == len(tokens)
    n = len(prompt.to_ints())
    torch.testing.assert_close(
        torch.tensor(lps[n:]), torch.tensor(a.sequences[0].logprobs), atol=1e-5, rtol=0
    )
    # the sampler keeps the snapshot's weights while training goes on
    datum = sft_datum(tokenizer, "What is 2 + 3?", " 5<|im_end|>")
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    again = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in a.sequences]


def test_keys_are_isolated_and_bad_input_changes_nothing(server) -> None:
    alice, bob = client(server, "tml-alice"), client(server, "tml-bob")
    training = alice.create_lora_training_client(BASE, rank=4).result()
    saved = training.save_state("mine").result().path
    with pytest.raises(Exception, match="404|not found"):
        bob.create_training_client_from_state(saved).result()
    sdk_data, _ = rl_data(2)
    before = training.forward(sdk_data, "cross_entropy").result().metrics["loss:sum"]
    bad = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 99999]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    with pytest.raises(Exception, match="token id|vocab"):  # one chunk: rejected whole
        training.forward_backward([sdk_data[0], bad], "cross_entropy").result()
    with pytest.raises(Exception, match="loss_fn"):
        training.forward_backward(sdk_data, "nonsense").result()
    training.optim_step(types.AdamParams(learning_rate=1e-1)).result()  # no gradients: no-op
    after = training.forward(sdk_data, "cross_entropy").result().metrics["loss:sum"]
    assert after == pytest.approx(before, abs=1e-6)
    with pytest.raises(Exception, match="not served"):
        alice.create_lora_training_client("Unknown/Model", rank=4).result()


def test_checkpoints_survive_a_restart(tmp_path) -> None:
    sdk_data, _ = rl_data(3)
    with serve(tmp_path) as url:
        training = client(url).create_lora_training_client(BASE, rank=4).result()
        training.forward_backward(sdk_data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        want = training.forward(sdk_data, "cross_entropy").result().metrics["loss:sum"]
        path = training.save_state("final").result().path
    with serve(tmp_path) as url:  # a new service process state, same --state-dir
        restored = client(url).create_training_client_from_state(path).result()
        got = restored.forward(sdk_data, "cross_entropy").result().metrics["loss:sum"]
        assert got == pytest.approx(want, abs=1e-5)
        info = rest(url).get_weights_info_by_tinker_path(path).result()
        assert info.is_lora and info.lora_rank == 4 and info.base_model == BASE


def test_cli_serves_the_sdk(tmp_path) -> None:
    args = ["--base-model", f"{BASE}=tiny-qwen3", "--state-dir", str(tmp_path / "state")]
    with cli_server([*args, "--hf-home", str(tmp_path / "hf")]) as url:
        service = client(url)
        caps = rest(url).get_server_capabilities().result()
        names = [m.model_name for m in caps.supported_models]
        assert names == [BASE]
        training = service.create_lora_training_client(BASE, rank=2).result()
        out = training.forward(rl_data(1)[0], "cross_entropy").result()
        assert np.isfinite(out.metrics["loss:sum"])
        # the served name resolves in the hub cache to the tokenizer the server uses
        repo = tmp_path / "hf" / "hub" / "models--Qwen--Qwen3-8B-Base"
        snapshot = repo / "snapshots" / (repo / "refs" / "main").read_text()
        text = "User: What is 12 + 7?"
        cached = AutoTokenizer.from_pretrained(snapshot)
        assert cached.encode(text) == training.get_tokenizer().encode(text)


def test_prompt_logprobs_top_k_and_last_n_match_a_teacher_forced_forward(server) -> None:
    sampler = client(server).create_sampling_client(base_model=BASE).result()
    model, tokenizer = build_preset("tiny-qwen3", seed=0)
    ids = tokenizer("What is 12 + 30? Think first.")["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    n = len(ids)
    want = logp[: n - 1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    top_v, top_i = torch.topk(logp[: n - 1], 3)
    params = types.SamplingParams(max_tokens=2, seed=1)
    prompt = types.ModelInput.from_ints(ids)
    out = sampler.sample(
        prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=3
    ).result()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), want, atol=1e-5, rtol=0)
    assert out.topk_prompt_logprobs[0] is None
    assert [[t for t, _ in row] for row in out.topk_prompt_logprobs[1:]] == top_i.tolist()
    got_v = torch.tensor([[v for _, v in row] for row in out.topk_prompt_logprobs[1:]])
    torch.testing.assert_close(got_v, top_v, atol=1e-5, rtol=0)
    last = sampler.sample(
        prompt, 1, params, include_prompt_logprobs=True, prompt_logprobs_last_n=4
    ).result()
    assert last.prompt_logprobs[: n - 4] == [None] * (n - 4)
    torch.testing.assert_close(
        torch.tensor(last.prompt_logprobs[-4:]), want[-4:], atol=1e-5, rtol=0
    )
    with pytest.raises(Exception, match="prompt_logprobs_last_n"):
        sampler.sample(
            prompt, 1, params, include_prompt_logprobs=True, prompt_logprobs_last_n=n
        ).result()
    with pytest.raises(Exception, match="prompt_alt_tokens_k: not supported"):
        sampler.sample(prompt, 1, params, prompt_alt_tokens_k=2).result()


def train_a_few_steps(url: str, key: str, seed: int) -> list[float]:
    training = client(url, key).create_lora_training_client(BASE, rank=4, seed=seed).result()
    sdk_data, _ = rl_data(4, seed=seed)
    out = []
    for _ in range(3):
        fb = training.forward_backward(sdk_data, "importance_sampling").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        out.append(fb.metrics["loss:sum"])
    out.append(training.forward(sdk_data, "importance_sampling").result().metrics["loss:sum"])
    return out


def test_clients_training_at_once_get_what_they_get_alone(server) -> None:
    from concurrent.futures import ThreadPoolExecutor

    alone = [train_a_few_steps(server, f"tml-solo{s}", s) for s in (11, 12)]
    with ThreadPoolExecutor(2) as pool:  # two keys, two models on one shared base, interleaved
        jobs = [pool.submit(train_a_few_steps, server, f"tml-duo{s}", s) for s in (11, 12)]
        together = [j.result() for j in jobs]
    assert alone[0] != alone[1]
    for a, b in zip(alone, together, strict=True):
        assert a == pytest.approx(b, abs=1e-6)


def test_a_resaved_sampler_path_serves_the_new_weights(server) -> None:
    service = client(server)
    training = service.create_lora_training_client(BASE, rank=4).result()
    tokenizer = training.get_tokenizer()
    tokens = types.ModelInput.from_ints(tokenizer("What is 7 + 1? 8")["input_ids"])
    path = training.save_weights_for_sampler("snap").result().path
    old = service.create_sampling_client(model_path=path).result()
    before = old.compute_logprobs(tokens).result()
    again = (
        service.create_sampling_client(model_path=path).result().compute_logprobs(tokens).result()
    )
    assert again == before  # a second client over the same snapshot sees the same weights
    datum = sft_datum(tokenizer, "What is 7 + 1?", " 8<|im_end|>")
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert training.save_weights_for_sampler("snap").result().path == path  # overwritten
    new = service.create_sampling_client(model_path=path).result().compute_logprobs(tokens).result()
    assert abs(new[-1] - before[-1]) > 1e-3
    assert old.compute_logprobs(tokens).result() == before  # a live sampler keeps its snapshot


def test_stop_ids_and_strings_include_the_terminator(server) -> None:
    sampler = client(server).create_sampling_client(base_model=BASE).result()
    tokenizer = build_preset("tiny-qwen3", seed=0)[1]
    prompt = types.ModelInput.from_ints(tokenizer("What is 2 + 3?")["input_ids"])
    free = types.SamplingParams(max_tokens=12, seed=5, stop=[])
    never = sampler.sample(prompt, 1, free).result().sequences[0]
    assert len(never.tokens) == 12 and never.stop_reason == "length"
    stop_id = never.tokens[4]  # a token the same seed will sample again
    first = never.tokens.index(stop_id)
    by_id = types.SamplingParams(max_tokens=12, seed=5, stop=[stop_id])
    seq = sampler.sample(prompt, 1, by_id).result().sequences[0]
    assert seq.tokens == never.tokens[: first + 1] and seq.stop_reason == "stop"
    text = tokenizer.decode(never.tokens[first + 1 : first + 3])
    by_text = types.SamplingParams(max_tokens=12, seed=5, stop=[text])
    seq = sampler.sample(prompt, 1, by_text).result().sequences[0]
    assert seq.stop_reason == "stop" and tokenizer.decode(seq.tokens).endswith(text)
    assert seq.tokens == never.tokens[: len(seq.tokens)]
