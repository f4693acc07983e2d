"""LoRA in `furlong train`: the actor trains a peft adapter (the Tinker service's adapter code)
on a weight-sharing view of the policy; the rollout engine samples from the merged weights,
and the run exports the merged model and, on request, the adapter alone (after a warm-up with
the warmed-up base it adapts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftConfig, PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from furlong.errors import InputError
from furlong.models import build_preset
from furlong.models.loading import save_hf_dir
from furlong.rl.config import load_config
from furlong.rl.loop import train

pytestmark = pytest.mark.usefixtures("one_thread", "short_reward")
IDS = torch.tensor([[5, 17, 300, 42, 9, 650]])


def lora_config(tmp_path, *extra: str):
    return load_config(
        None,
        [
            "model.name=tiny-qwen3",
            "model.lora_rank=8",
            "task.reward=short_text",
            "task.eval_size=4",
            "task.eval_samples=0",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.max_tokens=6",
            "algo.learning_rate=2e-2",
            "run.steps=6",
            "run.eval_every=6",
            "run.progress=false",
            "run.export_adapter=true",
            f"run.out_dir={tmp_path}",
            *extra,
        ],
    )


def test_a_lora_run_trains_the_adapter_and_exports_merged_and_adapter(tmp_path) -> None:
    summary = train(lora_config(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    # the rollout engine samples from the merged weights: the trainer agrees with it
    assert all(r["logprob_diff:mean"] < 1e-4 for r in steps if "logprob_diff:mean" in r)
    assert any(r.get("grad_norm:mean", 0) > 0 for r in steps)

    base, _ = build_preset("tiny-qwen3", seed=0)
    merged = AutoModelForCausalLM.from_pretrained(summary.hf_dir)
    adapted = PeftModel.from_pretrained(
        build_preset("tiny-qwen3", seed=0)[0], tmp_path / "policy_adapter"
    )
    with torch.no_grad():
        want = adapted(IDS).logits
        torch.testing.assert_close(merged(IDS).logits, want, atol=2e-5, rtol=0)
        assert (want - base(IDS).logits).abs().max() > 1e-3  # the adapter learned something
    # only the adapter trained: every weight outside it is the base's
    own = {k for k in merged.state_dict()}
    changed = [
        k
        for k, v in base.state_dict().items()
        if k in own and not torch.allclose(v, merged.state_dict()[k], atol=0, rtol=0)
    ]
    assert changed and all(
        any(
            t in k
            for t in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        )
        for k in changed
    ), changed


def test_an_adapter_exported_after_a_warm_up_loads_on_the_exported_base(tmp_path) -> None:
    """The adapter sits on the warmed-up weights, which no model name loads: the run exports
    them as policy_base/, the adapter names that directory, and base + adapter is policy/. On
    the preset base (what a user had before) the adapter is another model."""
    steps = ["warmup.steps=2", "warmup.batch_size=8", "run.steps=2", "run.eval_every=2"]
    summary = train(lora_config(tmp_path, *steps, "run.save_every=1"))
    base, adapter = tmp_path / "policy_base", tmp_path / "policy_adapter"
    named = PeftConfig.from_pretrained(str(adapter)).base_model_name_or_path
    assert named == str(base.resolve()) and Path(named).is_absolute()
    merged = AutoModelForCausalLM.from_pretrained(summary.hf_dir)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(named), adapter)
    on_preset = PeftModel.from_pretrained(build_preset("tiny-qwen3", seed=0)[0], adapter)
    with torch.no_grad():
        want = merged(IDS).logits
        torch.testing.assert_close(adapted(IDS).logits, want, atol=1e-4, rtol=0)
        assert (on_preset(IDS).logits - want).abs().max() > 0.1  # the test can fail
    # RL moved no base weight: step 1's checkpoint holds the same base as the export
    first = load_file(tmp_path / "checkpoints" / "step-000001" / "base" / "model.safetensors")
    last = load_file(base / "model.safetensors")
    assert first.keys() == last.keys() and all(torch.equal(first[k], last[k]) for k in first)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["colocate.enabled=true"], "LoRA is not supported with colocate.enabled"),
        (["model.lora_rank=-1"], r"model\.lora_rank: must be >= 0"),
        (["model.lora_rank=0"], r"run\.export_adapter: needs model\.lora_rank > 0"),
    ],
)
def test_unsupported_lora_combinations_are_refused(tmp_path, extra, match) -> None:
    with pytest.raises(InputError, match=match):
        lora_config(tmp_path, *extra)


@pytest.mark.parametrize("unembed", [False, True])
def test_a_lora_run_on_a_tied_model_publishes_what_it_trains(tmp_path, unembed: bool) -> None:
    """Tied embeddings (SmolLM2, Qwen3-0.6B): the merged weights name the shared tensor once,
    and an adapter on the head unties it everywhere (trainer, rollout engine, export)."""
    model, tokenizer = build_preset("tiny-qwen3", seed=0)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.get_input_embeddings().weight
    source = save_hf_dir(model, tokenizer, tmp_path / "tied")
    out = tmp_path / "run"
    extra = [f"model.name={source}", f"model.lora_unembed={str(unembed).lower()}"]
    summary = train(lora_config(out, *extra))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    diffs = [r["logprob_diff:mean"] for r in rows if "logprob_diff:mean" in r]
    assert diffs and max(diffs) < 1e-4  # the rollout engine samples what the trainer holds
    exported = AutoModelForCausalLM.from_pretrained(summary.hf_dir)
    head, embed = exported.lm_head.weight, exported.get_input_embeddings().weight
    assert torch.equal(head, embed) != unembed  # still tied unless the head was adapted
