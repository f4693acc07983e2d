"""Seeded presets are transformers' own Qwen3 and Llama classes; they save, reload, load by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)

from furlong.errors import InputError
from furlong.models import PRESETS, build_preset, load_model, save_hf_dir

EXPECTED_CLASS = {
    "tiny-qwen3": Qwen3ForCausalLM,
    "tiny-qwen3-moe": Qwen3MoeForCausalLM,
    "small-qwen3": Qwen3ForCausalLM,
    "small-llama": LlamaForCausalLM,
}
TEXT = "<|im_start|>user\nWhat is 3 + 4? café 東京<|im_end|>\n<|im_start|>assistant\n7"


def _ids(tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer(TEXT)["input_ids"]])


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_preset_names() -> None:
    assert set(PRESETS) == set(EXPECTED_CLASS)


@pytest.mark.parametrize("name", sorted(EXPECTED_CLASS))
def test_preset_builds_transformers_class(name: str) -> None:
    model, tokenizer = build_preset(name, seed=0)
    assert type(model) is EXPECTED_CLASS[name]
    assert model.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    cfg = model.config
    assert cfg.vocab_size % 64 == 0
    assert cfg.vocab_size >= len(tokenizer)
    assert model.get_input_embeddings().weight.shape[0] == cfg.vocab_size
    assert model.get_output_embeddings().weight.shape[0] == cfg.vocab_size
    assert cfg.head_dim == PRESETS[name].config["head_dim"]
    if name.startswith("tiny"):
        assert cfg.head_dim == 16
    assert cfg.eos_token_id == tokenizer.eos_token_id
    assert cfg.pad_token_id == tokenizer.pad_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    # The forward pass works and has the padded vocab width.
    ids = _ids(tokenizer)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all()


def test_moe_preset_routing() -> None:
    model, _ = build_preset("tiny-qwen3-moe", seed=0)
    assert model.config.num_experts == 8
    assert model.config.num_experts_per_tok == 2
    assert model.config.decoder_sparse_step == 1


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_same_seed_is_bit_identical(name: str) -> None:
    a, _ = build_preset(name, seed=3)
    b, _ = build_preset(name, seed=3)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_different_seed_differs(name: str) -> None:
    sa = build_preset(name, seed=0)[0].state_dict()
    sb = build_preset(name, seed=1)[0].state_dict()
    assert not torch.equal(sa["model.embed_tokens.weight"], sb["model.embed_tokens.weight"])
    assert not torch.equal(sa["lm_head.weight"], sb["lm_head.weight"])


def test_build_does_not_touch_global_rng() -> None:
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    build_preset("tiny-qwen3", seed=7)
    build_preset("tiny-qwen3-moe", seed=7)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_save_and_plain_transformers_reload(name: str, tmp_path: Path) -> None:
    model, tokenizer = build_preset(name, seed=0)
    model.eval()
    out = save_hf_dir(model, tokenizer, tmp_path / "m")
    assert out == tmp_path / "m"
    files = {p.name for p in out.iterdir()}
    assert "config.json" in files
    assert any(f.endswith(".safetensors") for f in files)
    assert "tokenizer.json" in files
    assert "tokenizer_config.json" in files

    reloaded = AutoModelForCausalLM.from_pretrained(out)
    reloaded_tok = AutoTokenizer.from_pretrained(out)
    assert type(reloaded) is EXPECTED_CLASS[name]
    assert reloaded.dtype == torch.float32
    assert reloaded.config.vocab_size == model.config.vocab_size

    sa, sb = model.state_dict(), reloaded.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k

    ids = _ids(tokenizer)
    assert reloaded_tok(TEXT)["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        want = model(ids).logits
        got = reloaded.eval()(ids).logits
    assert (want - got).abs().max() <= 1e-6


def test_save_is_atomic_and_replaces(tmp_path: Path) -> None:
    out = tmp_path / "m"
    a, tokenizer = build_preset("tiny-qwen3", seed=0)
    save_hf_dir(a, tokenizer, out)
    (out / "stale.txt").write_text("from the first write")
    b, _ = build_preset("tiny-qwen3", seed=1)
    assert save_hf_dir(b, tokenizer, out) == out

    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no .tmp- / .old- leftovers
    assert not (out / "stale.txt").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(reloaded.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(reloaded.lm_head.weight, a.lm_head.weight)


def test_load_model_preset_name() -> None:
    model, tokenizer = load_model("tiny-qwen3", seed=5)
    assert type(model) is Qwen3ForCausalLM
    assert tokenizer.eos_token == "<|im_end|>"
    ref, _ = build_preset("tiny-qwen3", seed=5)
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight)


def test_load_model_local_dir(tmp_path: Path) -> None:
    model, tokenizer = build_preset("tiny-qwen3-moe", seed=0)
    save_hf_dir(model, tokenizer, tmp_path / "m")
    loaded, loaded_tok = load_model(tmp_path / "m")
    assert type(loaded) is Qwen3MoeForCausalLM
    assert loaded.dtype == torch.float32
    assert loaded_tok(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_load_model_dir_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="config.json"):
        load_model(tmp_path / "empty")


def test_load_model_nonsense_spec_lists_presets() -> None:
    with pytest.raises(InputError) as info:
        load_model("no-such-preset-xyz")
    message = str(info.value)
    assert "no-such-preset-xyz" in message
    for name in PRESETS:
        assert name in message


def test_load_model_refuses_a_directory_without_tokenizer(tmp_path) -> None:
    model, _ = build_preset("tiny-qwen3")
    model.save_pretrained(tmp_path / "weights-only")
    with pytest.raises(InputError, match="tokenizer"):
        load_model(tmp_path / "weights-only")
    with pytest.raises(InputError, match="empty name"):
        load_model("")
