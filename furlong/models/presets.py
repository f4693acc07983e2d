"""Tiny models built from config with seeded random weights: transformers' own Qwen3 and Llama
classes.

The table imports nothing heavy (a config class is named, not imported), so the names are known
to `furlong --help` and to model-name checks without loading torch or transformers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

_ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# the small dense shape (3.5 M parameters), shared by the Qwen3 and Llama presets
_SMALL = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)


@dataclass(frozen=True)
class Preset:
    name: str
    config_class: str  # transformers' config class of the family, called with the fields
    config: dict[str, Any]
    description: str
    tokenizer_vocab: int = 2048  # BPE target; the corpus may support fewer merges

    def make_config(self, tokenizer: Any) -> PretrainedConfig:
        import transformers

        # Pad the embedding to a multiple of 64 rows, as real checkpoints do.
        return getattr(transformers, self.config_class)(
            vocab_size=-(-len(tokenizer) // 64) * 64,
            max_position_embeddings=2048,
            rope_theta=10_000.0,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            dtype="float32",
            **self.config,
        )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "tiny-qwen3",
            "Qwen3Config",
            dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, **_ATTENTION),
            "Qwen3 dense: hidden 64, 2 layers, vocab 768; tests and CI.",
        ),
        Preset(
            "tiny-qwen3-moe",
            "Qwen3MoeConfig",
            dict(
                hidden_size=64,
                intermediate_size=192,
                moe_intermediate_size=64,
                num_experts=8,
                num_experts_per_tok=2,
                decoder_sparse_step=1,
                norm_topk_prob=True,
                num_hidden_layers=2,
                **_ATTENTION,
            ),
            "Qwen3-MoE: hidden 64, 2 layers, 8 experts top-2, vocab 768; routing tests.",
        ),
        Preset(
            "small-qwen3",
            "Qwen3Config",
            _SMALL,
            "Qwen3 dense: hidden 256, 4 layers, vocab 768; the CPU demo.",
        ),
        Preset(
            "small-llama",
            "LlamaConfig",
            _SMALL,
            "Llama dense: hidden 256, 4 layers, vocab 768; the Llama-style recipe.",
        ),
    )
}


def build_preset(name: str, seed: int = 0) -> tuple[PreTrainedModel, Any]:
    """A seeded random model and the offline tokenizer, without touching the global RNG."""
    import torch
    from transformers import AutoModelForCausalLM

    from furlong.models.tokenizer import train_tokenizer

    preset = PRESETS[name]
    tokenizer = train_tokenizer(preset.tokenizer_vocab)
    config = preset.make_config(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
