"""The Tinker service's model pool with a multi-rank backend (``trainer_ranks=2``): a full
fine-tune trains on a TrainerGroup exactly like the in-process engine, saves and restores its
state (DCP), writes sampler snapshots, and its ranks stop when the model is removed. LoRA
models stay in process."""

from __future__ import annotations

from pathlib import Path

import pytest

from furlong.errors import InputError
from furlong.server.models import LoraSpec, ModelPool, sampling_model
from furlong.train.dist_checkpoint import saved_optimizer_kind
from furlong.train.engine import TrainingEngine
from furlong.train.group import TrainerGroup
from furlong.types import AdamParams
from tests.train.helpers import params, random_datums

ADAM = AdamParams(learning_rate=1e-4, grad_clip_norm=1.0)


def test_full_finetune_on_two_ranks_matches_one_process(tmp_path: Path) -> None:
    pool = ModelPool(
        {"base": "tiny-qwen3"},
        full_finetune=True,
        tokenizer_root=tmp_path / "tokenizers",
        trainer_ranks=2,
    )
    model = pool.create("m", "base", None)
    assert isinstance(model.engine, TrainerGroup) and model.engine.world_size == 2
    assert isinstance(pool.create("lora", "base", LoraSpec(rank=4)).engine, TrainingEngine)
    ref = TrainingEngine.from_pretrained("tiny-qwen3", seed=0)
    data = random_datums([5, 8, 3])
    for _ in range(2):
        a = ref.forward_backward(data, "cross_entropy")
        b = model.forward_backward(data, "cross_entropy", None, False)
        assert b.metrics["loss:sum"] == pytest.approx(a.metrics["loss:sum"], rel=1e-6)
        ref.optim_step(ADAM)
        model.optim_step(ADAM)

    model.save_state(tmp_path / "ckpt")
    # how the service reads a checkpoint's optimizer, of either format
    assert saved_optimizer_kind(tmp_path / "ckpt") == "adamw"
    assert saved_optimizer_kind(ref.save_state(tmp_path / "single")) == "adamw"
    with pytest.raises(InputError, match="saved for base_model"):  # checked, nothing changes
        model.engine.load_state(tmp_path / "ckpt", expect_info={"base_model": "elsewhere"})
    ref.forward_backward(data, "cross_entropy")
    ref.optim_step(ADAM)
    model.forward_backward(data, "cross_entropy", None, False)
    model.optim_step(ADAM)
    model.load_state(tmp_path / "ckpt", optimizer=True)  # back one step, then the same step
    model.forward_backward(data, "cross_entropy", None, False)
    model.optim_step(ADAM)

    model.save_sampler_weights(tmp_path / "snap")
    sampler, _ = sampling_model(pool, tmp_path / "snap")
    expected = params(ref)
    for name, p in sampler.named_parameters():
        assert float((p.detach() - expected[name]).abs().max()) <= 1e-6, name
    procs = list(model.engine._procs)
    pool.remove("m")
    assert all(not p.is_alive() for p in procs)
