"""The PPO critic: a causal LM's trunk (decoder stack + final norm) with a scalar value head.

The LM head is never part of the critic: the trunk is loaded or copied alone, so a tied
embedding stays with the policy and ``lm_head.weight`` ([V, H]) can never be mapped onto the
value head ([1, H]). Loading HF weights into an existing critic hides the head from the load
and restores it in a ``finally``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from safetensors import SafetensorError
from transformers import AutoModel, PreTrainedModel
from transformers.utils import logging as hf_logging

from furlong.errors import InputError
from furlong.models.loading import resolve
from furlong.models.presets import PRESETS, build_preset
from furlong.shapes import check_names_and_shapes

HEAD_STD = 0.02


class ValueModel(torch.nn.Module):
    """``values[b, t]``: the critic's estimate after reading tokens ``0..t`` of row ``b``."""

    def __init__(self, trunk: PreTrainedModel, seed: int = 0):
        super().__init__()
        self.trunk = trunk
        self.config = trunk.config
        weight = next(trunk.parameters())
        self.value_head = init_value_head(
            trunk.config.hidden_size, seed, dtype=weight.dtype, device=weight.device
        )
        _check_untied(self)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden_BTH = self.trunk(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        return self.head_values(hidden_BTH)

    def head_values(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 values of hidden states ``[..., H]`` -> ``[...]``."""
        return self.value_head(hidden).squeeze(-1).float()

    # what the TrainingEngine reads of a causal LM: the trunk is its decoder, no LM head
    def get_decoder(self) -> torch.nn.Module:
        return self.trunk

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.trunk.get_input_embeddings()

    def get_output_embeddings(self) -> None:
        return None


def init_value_head(
    hidden: int, seed: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.nn.Linear:
    """``Linear(hidden, 1)``: weight ~ N(0, 0.02) from a generator seeded with ``seed``, bias 0.

    Drawn in fp32 on CPU and then cast, so the init is the same for every dtype and device and
    the global RNG is untouched."""
    head = torch.nn.utils.skip_init(torch.nn.Linear, hidden, 1, bias=True)  # no RNG draw
    with torch.no_grad():
        torch.nn.init.normal_(
            head.weight, 0.0, HEAD_STD, generator=torch.Generator().manual_seed(seed)
        )
        head.bias.zero_()
    return head.to(device=device, dtype=dtype)


def critic_from_pretrained(
    spec: str | os.PathLike, seed: int = 0, dtype: torch.dtype = torch.float32
) -> ValueModel:
    """A critic on a preset's trunk (the policy's weights for the same ``seed``) or on the
    trunk of a pretrained model name or a local HF causal-LM directory; the head keeps its
    fresh init."""
    return ValueModel(load_trunk(spec, seed=seed, dtype=dtype), seed=seed)


def critic_from_policy(model: PreTrainedModel, seed: int = 0) -> ValueModel:
    """A critic on a deep copy of an in-memory policy's trunk: no storage is shared, so
    training the critic never moves the policy (or its tied embedding)."""
    return ValueModel(copy.deepcopy(_trunk_of(model)), seed=seed)


def load_trunk(
    spec: str | os.PathLike, seed: int = 0, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """The trunk alone: its loader is never asked for a value-head parameter."""
    spec = str(spec)
    if spec in PRESETS:
        model, _ = build_preset(spec, seed=seed)
        trunk = _trunk_of(model)
        # in place (Module.to returns self). transformers wraps PreTrainedModel.to with
        # functools.wraps(nn.Module.to), which typeshed types as the unbound function: self first
        trunk.to(dtype)  # type: ignore[arg-type]
        return trunk
    spec = resolve(spec)  # a pretrained name (smollm2-135m) as its cached HF directory
    if not (os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "config.json"))):
        raise InputError(f"critic: {spec!r} is neither a model name nor a local HF model directory")
    try:
        with _quiet_load_report():  # the LM head is left out on purpose: checked below instead
            base, info = AutoModel.from_pretrained(spec, dtype=dtype, output_loading_info=True)
    except (OSError, ValueError, SafetensorError) as exc:  # unreadable or corrupt files
        raise InputError(f"critic: cannot load the trunk of {spec!r} ({exc})") from None
    if info["missing_keys"]:
        raise InputError(f"critic: {spec!r} lacks trunk weights {sorted(info['missing_keys'])[:5]}")
    stray = sorted(k for k in info["unexpected_keys"] if not k.startswith(LM_HEAD_KEYS))
    if stray:  # anything but the LM head means the directory is not this trunk's causal LM
        raise InputError(f"critic: {spec!r} has weights the trunk does not use: {stray[:5]}")
    return _trunk_of(base)


LM_HEAD_KEYS = ("lm_head.",)  # a causal LM's head: in the checkpoint, never in the trunk


@contextmanager
def _quiet_load_report() -> Iterator[None]:
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)


@contextmanager
def hidden_head(critic: ValueModel) -> Iterator[torch.nn.Linear]:
    """Detach the head from the critic for the duration; it is put back even on error."""
    head = critic._modules.pop("value_head")
    try:
        assert isinstance(head, torch.nn.Linear)  # init_value_head's
        yield head
    finally:
        critic._modules["value_head"] = head


def load_hf_trunk(critic: ValueModel, spec: str | os.PathLike) -> None:
    """Overwrite an existing critic's trunk from a model name or HF directory (e.g. the actor's
    load path when there is no critic checkpoint). The head is hidden for the whole load, so
    the strict key match is against the trunk alone, and it is kept as it was."""
    dtype = next(critic.trunk.parameters()).dtype
    with hidden_head(critic):
        source = load_trunk(spec, dtype=dtype).state_dict()
        tensors = {f"trunk.{k}": v for k, v in source.items()}
        # all of it before the first copy
        check_names_and_shapes(tensors, critic.state_dict(), "critic: trunk", theirs="the critic's")
        critic.load_state_dict(tensors, strict=True)


def _trunk_of(model: PreTrainedModel) -> PreTrainedModel:
    """The decoder stack + final norm; for vision-language wrappers, the inner language model."""
    trunk = model.get_decoder() if hasattr(model, "get_decoder") else model
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and any(m is head for m in trunk.modules()):
        raise InputError(f"critic: {type(model).__name__} has no trunk separable from its LM head")
    return trunk


def _check_untied(critic: ValueModel) -> None:
    """The head must own its storage (a tied embedding would train the policy's input layer)."""
    trunk_ptrs = {t.untyped_storage().data_ptr() for t in critic.trunk.state_dict().values()}
    for name, p in critic.value_head.named_parameters():
        if p.untyped_storage().data_ptr() in trunk_ptrs:
            raise InputError(f"critic: value_head.{name} shares storage with the trunk")
