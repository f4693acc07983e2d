"""The model pool: LoRA adapters sharing one base, isolation, checkpoints, sampler snapshots."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from furlong.errors import InputError
from furlong.models import load_model
from furlong.server.models import LoraSpec, ModelPool, TrainingModel, sampling_model
from furlong.train.engine import TrainingEngine
from furlong.types import AdamParams
from tests.train.helpers import grads, params, random_datums

BASE = "Qwen/Qwen3-8B-Base"
ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)
IDS = torch.tensor([[5, 17, 300, 42, 9, 650, 12, 77]])

pytestmark = pytest.mark.usefixtures("one_thread")


def make_pool(tmp_path: Path, **kwargs: object) -> ModelPool:
    bases = {BASE: "tiny-qwen3", "tiny-qwen3": "tiny-qwen3", "moe": "tiny-qwen3-moe"}
    return ModelPool(bases, tokenizer_root=tmp_path / "tokenizers", **kwargs)  # type: ignore[arg-type]


def step(model: TrainingModel, seed: int, loss_fn: str = "cross_entropy"):
    """Two accumulated passes, then an optimizer step."""
    results = [
        model.forward_backward(random_datums([5, 8], loss_fn, seed=seed + i), loss_fn, None, False)
        for i in range(2)
    ]
    return results, model.optim_step(ADAM)


def logprobs(model: TrainingModel, seed: int = 100) -> list[torch.Tensor]:
    result = model.forward_backward(random_datums([6, 3], seed=seed), "cross_entropy", None, True)
    return [o["logprobs"] for o in result.outputs]


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_interleaved_models_match_models_trained_alone(tmp_path: Path) -> None:
    spec_x, spec_y = LoraSpec(rank=4), LoraSpec(rank=2, train_attn=False, seed=7)
    shared = make_pool(tmp_path)
    x = shared.create("s:train:0", BASE, spec_x)
    y = shared.create("s:train:1", BASE, spec_y)
    alone_x = make_pool(tmp_path / "a").create("s:train:0", BASE, spec_x)
    alone_y = make_pool(tmp_path / "b").create("s:train:1", BASE, spec_y)
    for a, b in ((x, alone_x), (y, alone_y)):  # seeded initialization
        pa, pb = params(a.engine), params(b.engine)
        assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)

    def run(model: TrainingModel, loss_fn: str, seed: int) -> list[float]:
        r = model.forward_backward(random_datums([5, 8], loss_fn, seed=seed), loss_fn, None, False)
        return [r.metrics["loss:sum"], *(o["logprobs"].sum().item() for o in r.outputs)]

    for s in range(2):
        # Interleaved: x accumulates over a pass of y and a forward-only pass of y.
        shared_out = [run(x, "cross_entropy", 10 * s), run(y, "ppo", 10 * s)]
        y.forward_backward(random_datums([4], seed=99), "cross_entropy", None, True)
        shared_out += [run(x, "cross_entropy", 10 * s + 1), run(y, "ppo", 10 * s + 1)]
        alone_out = [run(alone_x, "cross_entropy", 10 * s), run(alone_y, "ppo", 10 * s)]
        alone_out += [run(alone_x, "cross_entropy", 10 * s + 1), run(alone_y, "ppo", 10 * s + 1)]
        assert shared_out == alone_out
        for a, b in ((x, alone_x), (y, alone_y)):
            ga, gb = grads(a.engine), grads(b.engine)
            assert all(torch.equal(ga[n], gb[n]) for n in ga)
        assert x.optim_step(ADAM) == alone_x.optim_step(ADAM)
        assert y.optim_step(ADAM) == alone_y.optim_step(ADAM)
        for a, b in ((x, alone_x), (y, alone_y)):
            pa, pb = params(a.engine), params(b.engine)
            assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert any(not torch.equal(p, torch.zeros_like(p)) for p in params(x.engine).values())

    # The shared base weights never change.
    fresh, _ = load_model("tiny-qwen3")
    base, _ = shared.base(BASE)
    assert base.state_dict().keys() == fresh.state_dict().keys()
    assert all(torch.equal(t, fresh.state_dict()[n]) for n, t in base.state_dict().items())


def test_threads_on_one_base_match_sequential_runs(tmp_path: Path) -> None:
    def train(model: TrainingModel, seed: int) -> list:
        return [step(model, seed + 10 * i)[1] for i in range(3)]

    shared = make_pool(tmp_path)
    models = [shared.create(f"t{i}", BASE, LoraSpec(rank=2 + i)) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        threaded = list(pool.map(train, models, range(3)))
    for i, model in enumerate(models):
        alone = make_pool(tmp_path / str(i)).create(f"t{i}", BASE, LoraSpec(rank=2 + i))
        assert train(alone, i) == threaded[i]
        pa, pb = params(model.engine), params(alone.engine)
        assert all(torch.equal(pa[n], pb[n]) for n in pa)


def test_fresh_adapter_is_the_base_model(tmp_path: Path) -> None:
    pool = make_pool(tmp_path)
    model = pool.create("m", BASE, LoraSpec(rank=8))
    reference = TrainingEngine.from_pretrained("tiny-qwen3")
    expected = reference.forward(random_datums([6, 3], seed=100), "cross_entropy").outputs
    for got, want in zip(logprobs(model), expected, strict=True):
        torch.testing.assert_close(got, want["logprobs"], rtol=1e-6, atol=1e-6)
    b_params = [p for n, p in params(model.engine).items() if "lora_B" in n]
    assert b_params and all(not p.any() for p in b_params)
    base, _ = pool.base(BASE)
    assert type(base.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # no peft layers


def test_rank_and_targets_are_honoured(tmp_path: Path) -> None:
    pool = make_pool(tmp_path)
    attn = pool.create("a", BASE, LoraSpec(rank=3, train_mlp=False, train_unembed=False))
    mlp = pool.create("b", BASE, LoraSpec(rank=5, train_attn=False))

    def targets(model: TrainingModel) -> set[str]:
        return {n.split(".lora_")[0].rsplit(".", 1)[1] for n in model.engine.param_names}

    assert targets(attn) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert targets(mlp) == {"gate_proj", "up_proj", "down_proj", "lm_head"}
    assert len(attn.engine.param_names) == 2 * 4 * 2  # layers x modules x (A, B)
    for model, rank in ((attn, 3), (mlp, 5)):
        for name, p in params(model.engine).items():
            assert p.shape[0 if ".lora_A." in name else 1] == rank
    assert attn.lora_config() == {
        "rank": 3,
        "train_mlp": False,
        "train_attn": True,
        "train_unembed": False,
    }
    assert attn.is_lora and attn.lora_rank == 3


def test_moe_experts_get_adapters(tmp_path: Path) -> None:
    pool = make_pool(tmp_path)
    model = pool.create("m", "moe", LoraSpec(rank=2, train_attn=False, train_unembed=False))
    attn = pool.create("a", "moe", LoraSpec(rank=3, train_mlp=False))  # no expert adapters
    assert all(".mlp.experts." in n for n in model.engine.param_names)
    assert not any(".mlp." in n for n in attn.engine.param_names)
    with model._active():
        before = logits(model.engine.model)
    _, metrics = step(model, seed=0)
    assert metrics["grad_norm:mean"] > 0 and step(attn, seed=1)[1]["grad_norm:mean"] > 0
    fresh, _ = load_model("tiny-qwen3-moe")
    base, _ = pool.base("moe")
    assert all(torch.equal(t, fresh.state_dict()[n]) for n, t in base.state_dict().items())
    model.save_sampler_weights(tmp_path / "snap")
    sampler, _ = sampling_model(pool, tmp_path / "snap")
    with model._active():
        after = logits(model.engine.model)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(logits(sampler), after, rtol=1e-5, atol=1e-5)


def test_save_and_load_state(tmp_path: Path) -> None:
    pool = make_pool(tmp_path)
    spec = LoraSpec(rank=4)
    a = pool.create("a", BASE, spec)
    step(a, seed=0)
    step(a, seed=2)
    a.save_state(tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / "training_state.json").read_text())
    assert meta["kind"] == "params" and meta["info"]["base_model"] == BASE
    assert sorted(load_file(str(tmp_path / "ckpt" / "model.safetensors"))) == sorted(
        a.engine.param_names
    )  # the adapter only, no base weights

    b = pool.create("b", BASE, spec)
    b.load_state(tmp_path / "ckpt", optimizer=True)
    assert all(map(torch.equal, logprobs(a), logprobs(b)))
    assert b.engine.step == 2
    assert step(a, seed=4)[1] == step(b, seed=4)[1]
    pa, pb = params(a.engine), params(b.engine)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)

    c = pool.create("c", BASE, spec)
    c.load_state(tmp_path / "ckpt", optimizer=False)
    assert len(c.engine.optimizer.state) == 0 and c.engine.step == 0
    a.save_state(tmp_path / "ckpt2")
    c.load_state(tmp_path / "ckpt2", optimizer=False)
    assert all(torch.equal(pa[n], p) for n, p in params(c.engine).items())


def test_load_state_refuses_other_checkpoints(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, full_finetune=True)
    model = pool.create("m", BASE, LoraSpec(rank=4))
    step(model, seed=0)
    before = params(model.engine)
    pool.create("r8", BASE, LoraSpec(rank=8)).save_state(tmp_path / "rank8")
    pool.create("other", "tiny-qwen3", LoraSpec(rank=4)).save_state(tmp_path / "base")
    pool.create("full", BASE, None).save_state(tmp_path / "full")
    for path, match in (("rank8", "lora"), ("base", "base_model"), ("full", "whole model")):
        with pytest.raises(InputError, match=match):
            model.load_state(tmp_path / path, optimizer=True)
    with pytest.raises(InputError, match="not a furlong training checkpoint"):
        model.load_state(tmp_path / "missing", optimizer=True)
    assert all(torch.equal(before[n], p) for n, p in params(model.engine).items())
    assert model.engine.step == 1


def test_sampler_snapshot_is_independent_of_training(tmp_path: Path) -> None:
    pool = make_pool(tmp_path)
    model = pool.create("m", BASE, LoraSpec(rank=4))
    other = pool.create("o", BASE, LoraSpec(rank=2))
    step(model, seed=0)
    step(other, seed=5)
    model.save_sampler_weights(tmp_path / "snap")
    with model._active():
        expected = logits(model.engine.model)
    tensors = load_file(str(tmp_path / "snap" / "adapter_model.safetensors"))
    assert tensors and all(".lora_" in n for n in tensors)  # small: the adapter only

    sampler, tokenizer = sampling_model(pool, tmp_path / "snap")
    # the adapter applied on the base's own weights: no base weight is copied
    base_ptrs = {p.data_ptr() for p in pool.base(BASE)[0].parameters()}
    copied = [n for n, p in sampler.named_parameters() if p.data_ptr() not in base_ptrs]
    assert copied and all(".lora_" in n for n in copied)
    assert len(copied) == len(tensors)
    assert len(tokenizer) == len(pool.base(BASE)[1])
    torch.testing.assert_close(logits(sampler), expected, rtol=1e-5, atol=1e-5)
    snapshot = logits(sampler)
    step(model, seed=3)
    assert torch.equal(logits(sampler), snapshot)
    assert not torch.allclose(logits(model.engine.model), expected)
    with pytest.raises(InputError, match="not a furlong sampler snapshot"):
        sampling_model(pool, tmp_path / "missing")


def test_full_finetune_trains_every_weight(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, full_finetune=True)
    model = pool.create("f", BASE, None)
    assert not model.is_lora and model.lora_rank is None and model.lora_config() == {}
    named = dict(model.engine.model.named_parameters())
    assert model.engine.param_names == list(named)
    before = params(model.engine)
    step(model, seed=0)
    after = params(model.engine)
    assert all(not torch.equal(before[n], after[n]) for n in before)
    model.save_sampler_weights(tmp_path / "snap")
    sampler, _ = sampling_model(pool, tmp_path / "snap")
    torch.testing.assert_close(logits(sampler), logits(model.engine.model), rtol=0, atol=0)
    base, _ = pool.base(BASE)
    assert all(torch.equal(before[n], p) for n, p in base.named_parameters())


def test_bad_requests(tmp_path: Path) -> None:
    pool = make_pool(tmp_path)
    with pytest.raises(InputError, match=r"base_model: 'nope'.*Qwen/Qwen3-8B-Base, tiny-qwen3"):
        pool.create("m", "nope", LoraSpec(rank=4))
    for rank in (0, -1, 2.5, True):
        with pytest.raises(InputError, match="lora_config.rank"):
            LoraSpec(rank=rank)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="lora_config"):
        LoraSpec(rank=4, train_mlp=False, train_attn=False, train_unembed=False)
    with pytest.raises(InputError, match="lora_config: required"):
        pool.create("m", BASE, None)
    with pytest.raises(InputError, match="lora_config.rank"):
        pool.create("m", BASE, LoraSpec(rank=100_000))
    pool.create("m", BASE, LoraSpec(rank=4))
    with pytest.raises(InputError, match="model_id"):
        pool.create("m", BASE, LoraSpec(rank=4))
    with pytest.raises(KeyError):
        pool.get("unknown")


def test_remove_and_tokenizer_dir(tmp_path: Path) -> None:
    pool = make_pool(tmp_path)
    a = pool.create("s:train:0", BASE, LoraSpec(rank=4))
    b = pool.create("s:train:1", BASE, LoraSpec(rank=4))
    assert pool.get("s:train:0") is a and pool.names() == [BASE, "tiny-qwen3", "moe"]
    pool.remove("s:train:0")
    with pytest.raises(KeyError):
        pool.get("s:train:0")
    with pytest.raises(KeyError):
        logprobs(a)
    step(b, seed=0)
    pool.remove("s:train:1")
    again = pool.create("s:train:0", BASE, LoraSpec(rank=4))
    assert len(logprobs(again)) == 2

    path = again.tokenizer_dir
    assert ":" not in str(path) and path.parent == tmp_path / "tokenizers"
    assert path == pool.tokenizer_dir(BASE)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert (
        tokenizer("What is 3 + 4?")["input_ids"]
        == pool.base(BASE)[1]("What is 3 + 4?")["input_ids"]
    )
