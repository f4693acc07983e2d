"""save_state / load_state / export_hf: atomic writes and bit-identical continuation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from furlong.errors import InputError
from furlong.types import AdamParams
from tests.train.helpers import engine, params, random_datums

ADAM = AdamParams(learning_rate=5e-3, weight_decay=0.01, grad_clip_norm=1.0)


def train(e, steps: int, seed: int) -> list[float]:
    losses = []
    for i in range(steps):
        r = e.forward_backward(random_datums([6, 9, 4], "ppo", seed=seed + i), "ppo")
        e.optim_step(ADAM)
        losses.append(r.metrics["loss:sum"])
    return losses


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_save_load_continues_bit_identically(preset: str, tmp_path: Path) -> None:
    a = engine(preset)
    train(a, 2, seed=0)
    a.save_state(tmp_path / "ckpt")
    continued = train(a, 2, seed=10)

    b = engine(preset)
    train(b, 1, seed=99)  # different weights and optimizer state, overwritten by the load
    b.load_state(tmp_path / "ckpt")
    assert b.step == 2
    assert train(b, 2, seed=10) == continued
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


def test_load_without_optimizer_resets_it(tmp_path: Path) -> None:
    a = engine()
    train(a, 2, seed=0)
    a.save_state(tmp_path / "ckpt")
    b = engine()
    b.load_state(tmp_path / "ckpt", optimizer=False)
    assert all(
        torch.equal(x, y) for x, y in zip(params(a).values(), params(b).values(), strict=True)
    )
    assert len(b.optimizer.state) == 0 and b.step == 0


def test_save_is_atomic_and_overwrites(tmp_path: Path) -> None:
    e = engine()
    train(e, 1, seed=0)
    path = e.save_state(tmp_path / "ckpt")
    assert sorted(p.name for p in path.iterdir()) == [
        "model.safetensors",
        "optimizer.safetensors",
        "training_state.json",
    ]
    train(e, 1, seed=1)
    e.save_state(tmp_path / "ckpt")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp or old dirs left
    fresh = engine()
    fresh.load_state(tmp_path / "ckpt")
    assert fresh.step == 2


def test_bad_checkpoint_changes_nothing(tmp_path: Path) -> None:
    e = engine()
    train(e, 1, seed=0)
    before = params(e)
    with pytest.raises(InputError, match="not a furlong training checkpoint"):
        e.load_state(tmp_path / "missing")
    other = engine("tiny-qwen3-moe")
    other.save_state(tmp_path / "moe")
    with pytest.raises(InputError, match="does not match the model"):
        e.load_state(tmp_path / "moe")
    assert all(torch.equal(before[n], p) for n, p in params(e).items())
    assert e.step == 1


def test_export_hf_loads_unchanged(tmp_path: Path) -> None:
    e = engine()
    train(e, 1, seed=0)
    out = e.export_hf(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer("What is 3 + 4?")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, e.model(ids).logits, atol=0, rtol=0)
