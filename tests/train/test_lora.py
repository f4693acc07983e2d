"""LoRA merges (``merged_model``, ``merged_weights``, a LoRA trainer's ``export_hf``) and the
unmerged ``adapted_view`` equal the adapter model, also on a base with tied input/output
embeddings: an adapter on the LM head is merged into an untied copy of the head, so the input
embedding keeps the base weight; without one the merged model stays tied. The live trainer's
model is never moved by a merge, ``merged_weights`` copies no weight it does not change, and a
view shares every base weight."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen3Config

from furlong.models import PRESETS, build_preset
from furlong.train import lora
from furlong.train.engine import EngineConfig, TrainingEngine

pytestmark = pytest.mark.usefixtures("one_thread")
NAME = "m_test"
HEAD_ONLY = lora.LoraSpec(rank=4, train_mlp=False, train_attn=False, train_unembed=True)
NO_HEAD = lora.LoraSpec(rank=4, train_unembed=False)
EVERYTHING = lora.LoraSpec(rank=4)


@pytest.fixture(scope="module")
def tokenizer():
    return build_preset("tiny-qwen3")[1]


def tiny(tokenizer, family: str = "qwen3", tied: bool = True) -> PreTrainedModel:
    """tiny-qwen3's shape (hidden 64, 2 layers) as Qwen3 or Llama, tied or not, seeded."""
    config = PRESETS["tiny-qwen3"].make_config(tokenizer).to_dict()
    config["tie_word_embeddings"] = tied
    config_class = {"qwen3": Qwen3Config, "llama": LlamaConfig}[family]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config_class(**config), dtype=torch.float32)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model.eval()


def adapted(base: PreTrainedModel, spec: lora.LoraSpec) -> torch.nn.Module:
    """The trainer's LoRA (furlong's own helpers) with seeded nonzero A and B."""
    peft = lora.add_adapter(None, base, NAME, lora.peft_config(base, spec), seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in lora.adapter_params(peft, NAME):
            p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    return peft.eval()


def ids(vocab: int) -> torch.Tensor:
    return torch.randint(1, vocab, (2, 9), generator=torch.Generator().manual_seed(2))


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def max_diff(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        return (a(x).logits - b(x).logits).abs().max().item()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tied_merges_equal_the_adapter_model(tokenizer, family: str, tmp_path: Path) -> None:
    base = tiny(tokenizer, family)
    peft = adapted(base, EVERYTHING)
    base_before, peft_before = snapshot(base), snapshot(peft)
    x = ids(base.config.vocab_size)
    lora.save_adapter(tmp_path, peft, NAME)
    merged = {"merged_model": lora.merged_model(peft)}
    assert max_diff(peft, base, x) > 0.5  # the adapter moves the logits
    # the bug: peft alone merges the head's delta into the shared weight, moving the embedding
    with torch.no_grad():
        raw = copy.deepcopy(peft).merge_and_unload()
    assert max_diff(raw, peft, x) > 0.1
    for how, model in merged.items():
        assert max_diff(model, peft, x) <= 1e-5, how
        assert torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight), how
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
        assert not model.config.tie_word_embeddings, how
        assert not any(p.requires_grad for p in model.parameters())
    # the trainer's model (and the base it shares weights with) is untouched, still tied
    assert_unchanged(base, base_before)
    assert_unchanged(peft, peft_before)
    assert base.lm_head.weight is base.model.embed_tokens.weight and base.config.tie_word_embeddings
    storages = {t.data_ptr() for t in base.state_dict().values()}
    for model in merged.values():
        assert storages.isdisjoint(t.data_ptr() for t in model.state_dict().values())


def test_a_head_only_merge_is_base_plus_scaled_product(tokenizer, tmp_path: Path) -> None:
    base = tiny(tokenizer)
    peft = adapted(base, HEAD_ONLY)
    head = peft.get_base_model().lm_head
    a, b = head.lora_A[NAME].weight, head.lora_B[NAME].weight
    want = base.lm_head.weight + b @ a * (lora.ALPHA / HEAD_ONLY.rank)
    lora.save_adapter(tmp_path, peft, NAME)
    model = lora.merged_model(peft)
    torch.testing.assert_close(model.lm_head.weight, want, atol=1e-6, rtol=0)
    assert torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert max_diff(model, peft, ids(base.config.vocab_size)) <= 1e-5
    torch.testing.assert_close(lora.merged_weights(peft)["lm_head.weight"], want, atol=1e-6, rtol=0)


def test_an_adapter_off_the_head_keeps_the_embeddings_tied(tokenizer, tmp_path: Path) -> None:
    base = tiny(tokenizer)
    peft = adapted(base, NO_HEAD)
    lora.save_adapter(tmp_path, peft, NAME)
    model = lora.merged_model(peft)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # no copy was made
    assert model.config.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, base.lm_head.weight)
    assert max_diff(model, peft, ids(base.config.vocab_size)) <= 1e-5


def test_an_untied_model_merges_as_before(tokenizer, tmp_path: Path) -> None:
    base = tiny(tokenizer, tied=False)
    peft = adapted(base, EVERYTHING)
    before = snapshot(base)
    head = peft.get_base_model().lm_head
    want = base.lm_head.weight + head.lora_B[NAME].weight @ head.lora_A[NAME].weight * 8.0
    lora.save_adapter(tmp_path, peft, NAME)
    model = lora.merged_model(peft)
    assert max_diff(model, peft, ids(base.config.vocab_size)) <= 1e-5
    torch.testing.assert_close(model.lm_head.weight, want, atol=1e-6, rtol=0)
    assert torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert not model.config.tie_word_embeddings
    assert_unchanged(base, before)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("spec", [EVERYTHING, HEAD_ONLY, NO_HEAD], ids=["all", "head", "nohead"])
def test_merged_weights_equal_the_merged_copy_and_copy_no_base_weight(
    tokenizer, tied: bool, spec: lora.LoraSpec
) -> None:
    """What a LoRA trainer publishes: the merged copy's parameters, bit for bit (the same sum
    peft's merge makes), with every weight the adapter does not touch the base tensor itself."""
    base = tiny(tokenizer, tied=tied)
    peft = adapted(base, spec)
    before = snapshot(peft)
    want = dict(lora.merged_model(peft).named_parameters())
    got = lora.merged_weights(peft)
    assert list(got) == list(want)
    base_ptrs = {p.data_ptr() for p in base.parameters()}
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name
        touched = not torch.equal(want[name], base.state_dict()[name])
        assert (tensor.data_ptr() in base_ptrs) != touched, name
    assert_unchanged(peft, before)


@pytest.mark.parametrize("tied", [True, False])
def test_an_adapted_view_is_the_adapter_model_on_the_base_weights(
    tokenizer, tied: bool, tmp_path: Path
) -> None:
    """A LoRA sampler: the adapter from its saved files applied unmerged on the base's own
    weights (its only new tensors are the adapter's, as many bytes as the file's header says),
    with the adapter model's logits; training the base's PeftModel on afterwards leaves it."""
    base = tiny(tokenizer, tied=tied)
    peft = adapted(base, EVERYTHING)
    lora.save_adapter(tmp_path, peft, NAME)
    view = lora.adapted_view(base, tmp_path)
    x = ids(base.config.vocab_size)
    assert max_diff(view, peft, x) == 0.0  # the same ops as the trainer's peft forward
    assert max_diff(view, base, x) > 0.5
    base_ptrs = {p.data_ptr() for p in base.parameters()}
    own = {n: p for n, p in view.named_parameters() if p.data_ptr() not in base_ptrs}
    assert own and all(".lora_" in n for n in own)
    assert sum(p.nbytes for p in own.values()) == lora.adapter_file_bytes(tmp_path)
    assert not any(p.requires_grad for p in view.parameters())
    with torch.no_grad():
        want = view(x).logits
        for _, p in lora.adapter_params(peft, NAME):
            p.add_(0.1)
        assert torch.equal(view(x).logits, want)
    assert base.lm_head.weight is base.model.embed_tokens.weight or not tied


def test_export_hf_of_a_tied_lora_trainer_reloads_to_its_logits(tokenizer, tmp_path: Path) -> None:
    base = tiny(tokenizer)
    peft = adapted(base, EVERYTHING)
    before = snapshot(peft)
    engine = TrainingEngine(
        peft,
        tokenizer,
        EngineConfig(),
        trainable=lora.adapter_params(peft, NAME),
        merged=functools.partial(lora.merged_model, peft),
    )
    out = engine.export_hf(tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    peft.eval()
    assert max_diff(reloaded, peft, ids(base.config.vocab_size)) <= 1e-5
    assert torch.equal(reloaded.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert not reloaded.config.tie_word_embeddings
    assert_unchanged(peft, before)


def test_smollm2_merged_head_adapter_equals_the_adapter_model() -> None:
    """The real tied model (slow tier: the cached smollm2-135m): a nonzero LoRA on its LM head
    merged 12.9 off the adapter model before the untie, 4.8e-5 after (fp32 round-off: the
    logits reach ~30)."""
    from furlong.models import load_model

    base, tokenizer = load_model("smollm2-135m")
    peft = adapted(base.eval(), HEAD_ONLY)
    x = torch.tensor(
        [tokenizer("Paris is the capital and most populous city of France.")["input_ids"]]
    )
    merged = lora.merged_model(peft)
    assert max_diff(peft, base, x) > 0.5
    assert max_diff(merged, peft, x) <= 2e-4
    assert torch.equal(merged.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert base.lm_head.weight is base.model.embed_tokens.weight
