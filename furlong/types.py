"""Data contracts: small, frozen types that carry data between the parts of furlong."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from furlong.errors import InputError

INTEGER_INPUTS = frozenset({"target_tokens"})


def _as_tensor(value: Any, name: str, integer: bool) -> torch.Tensor:
    try:
        t = (
            value.detach()
            if isinstance(value, torch.Tensor)
            else torch.as_tensor(np.asarray(value))
        )
    except (TypeError, ValueError) as exc:
        raise InputError(f"{name}: cannot be read as a tensor ({exc})") from None
    if integer:
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise InputError(f"{name}: expected integer token ids, got dtype {t.dtype}")
        return t.to(torch.int64).cpu()
    if t.dtype == torch.bool or t.is_complex():
        raise InputError(f"{name}: expected real numbers, got dtype {t.dtype}")
    return t.to(torch.float32).cpu()


@dataclass(frozen=True)
class Datum:
    """One training example with Tinker semantics.

    ``model_input`` holds token ids ``[T]``; position ``i`` predicts
    ``loss_fn_inputs["target_tokens"][i]`` (shape ``[T]``, or ``[T, K]`` for the top-K form of
    cross_entropy). Per-token inputs (``weights``, ``logprobs``, ``advantages``) share that shape.
    """

    model_input: torch.Tensor
    loss_fn_inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        tokens = _as_tensor(self.model_input, "model_input", integer=True)
        if tokens.dim() != 1:
            raise InputError(f"model_input: expected a 1-D list of token ids, got {tokens.dim()}-D")
        inputs = {
            str(k): _as_tensor(v, f"loss_fn_inputs[{k!r}]", integer=k in INTEGER_INPUTS)
            for k, v in dict(self.loss_fn_inputs).items()
        }
        object.__setattr__(self, "model_input", tokens)
        object.__setattr__(self, "loss_fn_inputs", MappingProxyType(inputs))

    def __len__(self) -> int:
        return int(self.model_input.numel())

    def __reduce__(self) -> tuple:
        # the read-only view of the inputs does not pickle: rebuild from a plain dict
        return (type(self), (self.model_input, dict(self.loss_fn_inputs)))

    @classmethod
    def next_token(cls, tokens: Sequence[int] | torch.Tensor, **response: torch.Tensor) -> Datum:
        """Teacher forcing over ``tokens`` (prompt + response): ``model_input`` is
        ``tokens[:-1]`` and ``target_tokens`` is ``tokens[1:]``, so the response occupies the
        last ``n`` target positions. Each ``response`` input holds those ``n`` positions (all
        the same length) and is zero-filled over the prompt's."""
        ids = torch.as_tensor(tokens)
        lengths = {k: v.shape[0] for k, v in response.items()}
        if len(set(lengths.values())) > 1 or any(n > ids.numel() - 1 for n in lengths.values()):
            raise InputError(
                f"loss_fn_inputs: response lengths {lengths} must be equal and fit "
                f"{ids.numel() - 1} target positions"
            )
        full = {
            k: torch.cat([v.new_zeros(ids.numel() - 1 - v.shape[0], *v.shape[1:]), v])
            for k, v in response.items()
        }
        return cls(ids[:-1], {"target_tokens": ids[1:], **full})


@dataclass(frozen=True)
class ForwardResult:
    """Per-datum outputs in request order and metrics named ``name:reduction``.

    Each output holds ``logprobs`` (float32, shape of ``target_tokens``) and ``loss`` (float32,
    0-d), detached on CPU.
    """

    outputs: list[dict[str, torch.Tensor]]
    metrics: dict[str, float]


@dataclass(frozen=True)
class AdamParams:
    """Tinker's AdamParams: one AdamW step's hyper-parameters (``grad_clip_norm`` 0 = off)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def __post_init__(self) -> None:
        for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InputError(f"adam_params.{name}: expected a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise InputError(f"adam_params.{name}: must be finite and >= 0, got {value}")
        for name in ("beta1", "beta2"):
            if getattr(self, name) >= 1:
                raise InputError(
                    f"adam_params.{name}: must be in [0, 1), got {getattr(self, name)}"
                )
