"""An exported LoRA adapter names its base as the user gave it (`model.name`), so peft finds
the base from the adapter directory alone; after a warm-up (the adapter sits on warmed-up
weights no name loads) it names the warmed-up base the run exports beside it, policy_base/
(tests/rl/test_lora_train.py checks that base + adapter is the merged policy)."""

from __future__ import annotations

import pytest
import torch
from peft import PeftConfig, PeftModel
from transformers import AutoModelForCausalLM

from furlong.models import build_preset
from furlong.models.loading import save_hf_dir
from furlong.rl.config import load_config
from furlong.rl.loop import train
from tests.rl.conftest import one_step_run

pytestmark = pytest.mark.usefixtures("one_thread", "short_reward")
IDS = torch.tensor([[5, 17, 300, 42, 9, 650]])


def adapter_run(tmp_path, model: str, *extra: str):
    out = tmp_path / "run"
    lora = ["model.lora_rank=4", "task.reward=short_text", "run.export_adapter=true"]
    overrides = one_step_run(out, f"model.name={model}", *lora, "run.tensorboard=false", *extra)
    config = load_config(None, overrides)
    train(config)
    return out / "policy_adapter"


def test_a_preset_base_is_named_by_its_preset(tmp_path) -> None:
    adapter = adapter_run(tmp_path, "tiny-qwen3")
    assert PeftConfig.from_pretrained(str(adapter)).base_model_name_or_path == "tiny-qwen3"


def test_a_local_base_is_named_by_its_path_and_loads_from_it(tmp_path) -> None:
    base_dir = str(save_hf_dir(*build_preset("tiny-qwen3", seed=0), tmp_path / "base"))
    adapter = adapter_run(tmp_path, base_dir)
    named = PeftConfig.from_pretrained(str(adapter)).base_model_name_or_path
    assert named == base_dir
    # peft's recipe: the base from the adapter's config, then the adapter on it
    found = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(named), str(adapter))
    given = PeftModel.from_pretrained(build_preset("tiny-qwen3", seed=0)[0], str(adapter))
    with torch.no_grad():
        torch.testing.assert_close(found(IDS).logits, given(IDS).logits, atol=0, rtol=0)
        plain = build_preset("tiny-qwen3", seed=0)[0](IDS).logits
        assert (given(IDS).logits - plain).abs().max() > 1e-4  # the adapter is not a no-op


def test_after_a_warm_up_the_exported_warmed_up_base_is_named(tmp_path) -> None:
    adapter = adapter_run(tmp_path, "tiny-qwen3", "warmup.steps=1", "warmup.batch_size=2")
    named = PeftConfig.from_pretrained(str(adapter)).base_model_name_or_path
    assert named == str((tmp_path / "run" / "policy_base").resolve())
    assert (tmp_path / "run" / "policy_base" / "config.json").is_file()
