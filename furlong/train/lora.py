"""LoRA adapters through peft, with Tinker's ``LoraConfig`` semantics.

Rank from the request, alpha 32, dropout 0. ``train_attn`` targets the q/k/v/o projections,
``train_mlp`` the MLP projections (gate/up/down, and the fused expert weights of MoE layers
through peft's ``target_parameters``), ``train_unembed`` puts a LoRA on the LM head (Tinker:
"whether to add lora to the unembedding layer"; peft's ``modules_to_save`` would instead train
a full per-adapter copy of the head).

Many adapters live on one ``PeftModel`` per base; that PeftModel wraps a weight-sharing view of
the base (``share_weights``), so the base itself stays a plain model for base sampling.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import re
import warnings
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig, PreTrainedModel

from furlong.errors import InputError
from furlong.models.lora_view import MergedWeights, adapted
from furlong.train import checkpoint as ckpt

ALPHA = 32
ATTN_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
MLP_MODULES = frozenset({"gate_proj", "up_proj", "down_proj"})
# MoE experts in transformers 5 are 3-D parameters of an ``experts`` module, not nn.Linear.
EXPERT_PARAMS = frozenset({"gate_up_proj", "gate_proj", "up_proj", "down_proj"})
WEIGHTS_FILE = "adapter_model.safetensors"  # with peft's adapter_config.json: a peft adapter dir


@dataclass(frozen=True)
class LoraSpec:
    """A client's LoRA request (Tinker ``LoraConfig``); ``seed`` None: derived from the id."""

    rank: int
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise InputError(f"lora_config.rank: must be an integer >= 1, got {self.rank!r}")
        for field in ("train_mlp", "train_attn", "train_unembed"):
            if not isinstance(getattr(self, field), bool):
                raise InputError(f"lora_config.{field}: must be a boolean")
        if not (self.train_mlp or self.train_attn or self.train_unembed):
            raise InputError(
                "lora_config: train_mlp, train_attn and train_unembed are all false "
                "(nothing to train)"
            )
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise InputError(f"lora_config.seed: must be an integer, got {self.seed!r}")

    def as_dict(self) -> dict[str, int | bool]:
        return {
            "rank": self.rank,
            "train_mlp": self.train_mlp,
            "train_attn": self.train_attn,
            "train_unembed": self.train_unembed,
        }


def peft_config(model: PreTrainedModel, spec: LoraSpec) -> LoraConfig:
    """Targets found in ``model`` (a plain HF causal LM) for ``spec``."""
    modules: set[str] = set()
    params: set[str] = set()
    head = model.get_output_embeddings()
    for path, module in model.named_modules():
        leaf = path.rpartition(".")[2]
        wanted = (
            (spec.train_unembed and module is head)
            or (spec.train_attn and leaf in ATTN_MODULES)
            or (spec.train_mlp and leaf in MLP_MODULES)
        )
        if wanted and isinstance(module, torch.nn.Linear):
            modules.add(leaf)
        if spec.train_mlp and leaf == "experts":
            params.update(
                f"experts.{n}"
                for n, p in module.named_parameters(recurse=False)
                if n in EXPERT_PARAMS and p.dim() == 3
            )
    if not modules and not params:
        raise InputError(f"lora_config: {spec.as_dict()} selects no layer of this base model")
    return LoraConfig(
        r=spec.rank,
        lora_alpha=ALPHA,
        lora_dropout=0.0,
        bias="none",
        target_modules=sorted(modules),
        target_parameters=sorted(params) or None,
    )


def share_weights(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the module tree whose parameters and buffers *are* the original's: peft injects
    its layers into the copy, the original stays a plain model, and no weight is duplicated."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def adapter_name(model_id: str, taken: Collection[str]) -> str:
    """A peft adapter name (a ModuleDict key: no dots) unique among ``taken``."""
    base = "m_" + re.sub(r"[^A-Za-z0-9_]", "_", model_id)
    name, n = base, 1
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    return name


def derive_seed(pool_seed: int, model_id: str) -> int:
    digest = hashlib.sha256(f"{pool_seed}/{model_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def add_adapter(
    peft_model: PeftModel | None,
    base: torch.nn.Module,
    name: str,
    config: LoraConfig,
    seed: int,
) -> PeftModel:
    """Adds adapter ``name`` initialized from ``seed`` (peft's B = 0: it starts as the base),
    wrapping a weight-sharing view of ``base`` on first use. The global RNG is untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if peft_model is None:
            return _wrap(base, config, name)
        try:
            peft_model.add_adapter(name, config)
        except BaseException:
            if name in peft_model.peft_config:
                peft_model.delete_adapter(name)
            raise
    return peft_model


def _wrap(base: torch.nn.Module, config: LoraConfig, name: str) -> PeftModel:
    """peft's wrapper over a weight-sharing view of ``base``. peft 0.21 asks transformers 5
    for ``is_gradient_checkpointing``, deprecated there: a FutureWarning on every model that no
    user caused and none can act on, so it is silenced here alone."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        return get_peft_model(share_weights(base), config, adapter_name=name)


def adapter_params(peft_model: torch.nn.Module, name: str) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapter's parameters, named as in a peft adapter file (adapter name removed), so a
    checkpoint loads into another model id's adapter."""
    marker = f".{name}."
    return [(n.replace(marker, "."), p) for n, p in peft_model.named_parameters() if marker in n]


def save_adapter(
    out: Path, peft_model: PeftModel, name: str, base_model: str | None = None
) -> None:
    """Write a standard peft adapter directory (``PeftModel.from_pretrained`` reads it) whose
    ``base_model_name_or_path`` is ``base_model``, the base as the user named it (None: no
    name; peft would record the loaded model's own, empty for a preset, a cache path for a
    pretrained name, the original weights after a warm-up)."""
    # peft would add the whole LM head when it is a LoRA target ("auto"): the base has it.
    tensors = get_peft_model_state_dict(peft_model, adapter_name=name, save_embedding_layers=False)
    save_file(tensors, str(out / WEIGHTS_FILE))
    config = copy.copy(peft_model.peft_config[name])  # the live model's stays as peft made it
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(out))


def adapted_view(base: PreTrainedModel, adapter_dir: Path) -> PreTrainedModel:
    """A model of ``base``'s class whose weights *are* ``base``'s, with the adapter of
    ``adapter_dir`` applied unmerged (peft's LoRA layers): it costs the adapter's tensors, never
    a copy of the base, and later training of other adapters on the base cannot change it."""
    config = LoraConfig.from_pretrained(str(adapter_dir))
    config.base_model_name_or_path = None  # the file's name of its base is a label: base is it
    tensors = load_file(str(adapter_dir / WEIGHTS_FILE))
    name = "m_snapshot"
    with torch.random.fork_rng(devices=[]):  # peft initializes the adapter before the load
        model = _wrap(base, config, name)
    ckpt.check_tensors(dict(adapter_params(model, name)), tensors)
    set_peft_model_state_dict(model, tensors, adapter_name=name)
    view = cast(PreTrainedModel, model.get_base_model())  # the HF model, LoRA layers in it
    view.requires_grad_(False)
    return view


def adapter_file_bytes(adapter_dir: Path) -> int:
    """What ``adapted_view`` allocates for ``adapter_dir``: its tensors' bytes, read from the
    safetensors header before anything is loaded."""
    return ckpt.safetensors_bytes(adapter_dir / WEIGHTS_FILE)


def merged_model(peft_model: PeftModel) -> PreTrainedModel:
    """A plain HF model with the active adapter merged (for an HF export). Merged on a copy:
    merging in place and unmerging afterwards would leave round-off in the trained weights.
    A rollout engine takes :func:`merged_weights` instead, which copies no model."""
    return merge(copy.deepcopy(peft_model))


def merged_weights(peft_model: PeftModel) -> Mapping[str, torch.Tensor]:
    """The parameters of ``merged_model(peft_model)`` by name, without copying the model: a
    weight under the active adapter is computed when it is read (base + peft's delta, the sum
    ``merge_and_unload`` makes), every other weight is the base tensor itself. A publish that
    copies them one by one holds one layer's delta at a time. Adapters on parameters (MoE
    experts) take the merged copy."""
    if any(
        isinstance(m, LoraLayer) and not isinstance(m, LoraLinear) for m in peft_model.modules()
    ):
        return {n: p.detach() for n, p in merged_model(peft_model).named_parameters()}
    return MergedWeights(peft_model.get_base_model())


def merge(model: PeftModel) -> PreTrainedModel:
    """Merge the active adapter of ``model`` (a copy the caller owns: it is merged in place) and
    return the plain model. Every merge goes through here, so tied embeddings stay correct."""
    with torch.no_grad():
        untie_for_merge(model)
        merged = model.merge_and_unload()
    merged.requires_grad_(False)
    return merged


def untie_for_merge(model: PeftModel) -> bool:
    """Give the LM head its own copy of a tied embedding when the active adapter is on either
    of them (True), so a merge moves only the layer the adapter is on: merging into the shared
    weight would move both, while the adapter model embeds with the base weight (and vice
    versa). Otherwise they stay tied (no copy). Call it on a copy: it replaces a parameter."""
    base = cast(PreTrainedModel, model.get_base_model())  # peft annotates an nn.Module
    inputs, head = base.get_input_embeddings(), base.get_output_embeddings()
    if inputs is None or head is None or not (adapted(inputs) or adapted(head)):
        return False
    return _untie(_base_layer(inputs), _base_layer(head), base.config, requires_grad=False)


def untie_embeddings(model: PreTrainedModel) -> bool:
    """Give a tied LM head its own copy of the embedding (True if it was tied): before a LoRA
    adapts the head, which then stops equalling the embedding, so that the trainer, the rollout
    engine and an export all hold the two as separate weights."""
    inputs, head = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is None or head is None:
        return False
    return _untie(inputs, head, model.config, requires_grad=True)


def _untie(
    inputs: torch.nn.Module, head: torch.nn.Module, config: PretrainedConfig, requires_grad: bool
) -> bool:
    """``head`` gets a copy of the weight it shares with ``inputs`` (False if it shares none)."""
    weight = inputs.weight
    assert isinstance(weight, torch.Tensor) and isinstance(head.weight, torch.Tensor)  # Parameters
    if weight is not head.weight and weight.data_ptr() != head.weight.data_ptr():
        return False
    head.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=requires_grad)
    # save_pretrained / from_pretrained (and peft's merge check) read the flag, not the storage
    config.tie_word_embeddings = False
    config.get_text_config().tie_word_embeddings = False  # the same object unless multimodal
    return True


def _base_layer(module: torch.nn.Module) -> torch.nn.Module:
    return module.get_base_layer() if isinstance(module, LoraLayer) else module
