"""The merged weights of a model with peft's LoRA layers in it, read without merging in place:
what a rollout engine is sent for a LoRA policy or snapshot (``train.lora.merged_weights``
and the vLLM kind both read them). Here, below train/ and rollout/, so both may."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer

from furlong.errors import InputError


def merged_view_weights(model: torch.nn.Module) -> Mapping[str, torch.Tensor]:
    """:func:`merged_weights` of a model with peft's LoRA layers in it and no wrapper (what
    :func:`adapted_view` returns): linear adapters only, merged as they are read."""
    if any(isinstance(m, LoraLayer) and not isinstance(m, LoraLinear) for m in model.modules()):
        raise InputError("weights: an adapter on a non-linear layer needs its PeftModel to merge")
    return MergedWeights(model)


class MergedWeights(Mapping[str, torch.Tensor]):
    def __init__(self, model: torch.nn.Module):
        self._weights: dict[str, tuple[torch.Tensor, LoraLinear | None]] = {}
        layers = {path: m for path, m in model.named_modules() if isinstance(m, LoraLinear)}
        tuned = {id(m.base_layer.weight) for m in layers.values() if adapted(m)}
        seen: set[int] = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            if ".lora_" in name:
                continue
            path, _, leaf = name.rpartition(".")
            layer = layers.get(path.removesuffix(".base_layer"))
            clean = name.replace(".base_layer.", ".")
            # a tied weight is one parameter, unless an adapter is on one of its layers: then
            # merge unties it and each name has its own (see untie_for_merge)
            if id(p) in seen and id(p) not in tuned:
                continue
            seen.add(id(p))
            merges = layer is not None and leaf == "weight" and adapted(layer)
            self._weights[clean] = (p.detach(), layer if merges else None)

    def __getitem__(self, name: str) -> torch.Tensor:
        weight, layer = self._weights[name]
        if layer is None:
            return weight
        with torch.no_grad():
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    weight = weight + layer.get_delta_weight(adapter)
        return weight

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


def adapted(module: torch.nn.Module) -> bool:
    """A LoRA layer holding weights of an active adapter (what ``merge_and_unload`` merges)."""
    if not isinstance(module, LoraLayer):
        return False
    held = set(module.lora_A) | set(module.lora_embedding_A)
    return bool(held & set(module.active_adapters))
