"""The CriticEngine: values and the clipped value loss for a PPO critic (a ValueModel).

Same semantics as the TrainingEngine: raw sums over tokens and datums (the caller owns
normalization through ``weights``), gradients accumulate until ``optim_step``, microbatching
by a token budget never changes results, and a request is validated whole before any compute.
The critic has its own AdamW, so its learning rate is independent of the actor's.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from furlong.errors import InputError
from furlong.models.critic import ValueModel
from furlong.train import checkpoint as ckpt
from furlong.train.batching import plan_microbatches
from furlong.train.optim import build_adamw, optimizer_step
from furlong.types import AdamParams, Datum

INFO = {"role": "critic"}  # stored with checkpoints: an actor checkpoint is refused by name


@dataclass(frozen=True)
class CriticConfig:
    max_tokens_per_microbatch: int = 8192  # padded tokens per forward pass; <= 0: one pass
    value_clip: float | None = 0.2  # PPO value clipping range around old values; None: off
    device: str = "cpu"

    def __post_init__(self) -> None:
        c = self.value_clip
        if c is not None and (isinstance(c, bool) or not isinstance(c, int | float)):
            raise InputError(f"value_clip: expected a number or None, got {c!r}")
        if c is not None and not (math.isfinite(c) and c > 0):
            raise InputError(f"value_clip: must be finite and > 0 (or None), got {c}")


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    weights: torch.Tensor,
    clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token ``w·½·max((v−R)², (old + clamp(v−old, −c, c) − R)²)`` (``w·½·(v−R)²`` when
    ``clip`` is None), and where the clipped branch is strictly the larger one."""
    unclipped = (values - returns).square()
    if clip is None:
        return 0.5 * weights * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns).square()
    return 0.5 * weights * torch.maximum(unclipped, clipped), clipped > unclipped


class CriticEngine:
    """Trains one ValueModel; every value the RL loop uses comes from ``values``."""

    def __init__(self, model: ValueModel, config: CriticConfig | None = None):
        self.config = config or CriticConfig()
        self.model = model.to(self.config.device)
        self.model.train()  # dropout is 0 in the supported families; one mode for both passes
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.optimizer = build_adamw(self.params)
        self.step = 0
        self.vocab_size = int(self.model.trunk.get_input_embeddings().num_embeddings)
        self.max_length = getattr(self.model.config, "max_position_embeddings", None)
        self.pad_token_id = int(getattr(self.model.config, "pad_token_id", None) or 0)

    # ---------------------------------------------------------------- passes

    def values(self, datums: Sequence[Datum]) -> list[torch.Tensor]:
        """Per datum, float32 ``[len(datum)]`` on CPU: value *i* is read at input position *i*
        and so is aligned with ``target_tokens[i]``."""
        self._check_datums(datums)
        out: list[torch.Tensor | None] = [None] * len(datums)
        with torch.no_grad():
            for group in self._plan(datums):
                values_R = self._values_rows(datums, group).cpu()
                for i, v in zip(
                    group, values_R.split([len(datums[i]) for i in group]), strict=True
                ):
                    out[i] = v.clone()
        return out  # type: ignore[return-value]

    def forward_backward(
        self,
        datums: Sequence[Datum],
        returns: Sequence[torch.Tensor],
        old_values: Sequence[torch.Tensor],
        weights: Sequence[torch.Tensor],
    ) -> dict[str, float]:
        """Backward of the raw-sum clipped value loss; gradients accumulate until ``optim_step``."""
        self._check_datums(datums)
        inputs = [
            _per_token(name, given, datums)
            for name, given in (
                ("returns", returns),
                ("old_values", old_values),
                ("weights", weights),
            )
        ]
        loss_sum, clipped, active, value_sum = 0.0, 0, 0, 0.0
        for group in self._plan(datums):
            returns_R, old_R, weights_R = (
                torch.cat([per[i] for i in group]).to(self.config.device) for per in inputs
            )
            values_R = self._values_rows(datums, group)
            per_token, clipped_R = value_loss(
                values_R, returns_R, old_R, weights_R, self.config.value_clip
            )
            total = per_token.sum()
            total.backward()
            on = weights_R != 0  # metrics over tokens that carry loss (not prompt tokens)
            loss_sum += float(total.detach())
            clipped += int((clipped_R & on).sum())
            active += int(on.sum())
            value_sum += float(values_R.detach()[on].sum())
        return {
            "value_loss:sum": loss_sum,
            "value_clipfrac:mean": clipped / active if active else 0.0,
            "values:mean": value_sum / active if active else 0.0,
            "num_tokens:sum": float(sum(len(d) for d in datums)),
        }

    def _plan(self, datums: Sequence[Datum]) -> list[list[int]]:
        return plan_microbatches([len(d) for d in datums], self.config.max_tokens_per_microbatch)

    def _values_rows(self, datums: Sequence[Datum], group: list[int]) -> torch.Tensor:
        """Right-padded forward of one microbatch; the real positions, flat in group order."""
        lengths = [len(datums[i]) for i in group]
        width = max(lengths)
        ids = torch.full((len(group), width), self.pad_token_id, dtype=torch.int64)
        attn = torch.zeros((len(group), width), dtype=torch.int64)
        for j, (i, n) in enumerate(zip(group, lengths, strict=True)):
            ids[j, :n] = datums[i].model_input
            attn[j, :n] = 1
        device = self.config.device
        values_BT = self.model(ids.to(device), attn.to(device))
        return values_BT[attn.to(device).bool()]  # row-major: datum by datum, in order

    def _check_datums(self, datums: Sequence[Datum]) -> None:
        if isinstance(datums, Datum) or not isinstance(datums, Sequence) or not datums:
            raise InputError("datums: expected a non-empty list of Datum")
        for i, d in enumerate(datums):
            if not isinstance(d, Datum):
                raise InputError(f"datum {i}: expected a Datum, got {type(d).__name__}")
            n = len(d)
            if n == 0:
                raise InputError(f"datum {i}: model_input is empty")
            if self.max_length is not None and n > self.max_length:
                raise InputError(
                    f"datum {i}: model_input has {n} tokens, more than the model's "
                    f"{self.max_length}"
                )
            ids = d.model_input
            if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
                bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
                raise InputError(
                    f"datum {i}: model_input holds token id {bad}, outside [0, {self.vocab_size})"
                )

    # ---------------------------------------------------------------- optimizer

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        metrics = optimizer_step(self.params, self.optimizer, adam)
        if not metrics["skipped_nonfinite:sum"]:
            self.step += 1
        metrics["step:max"] = float(self.step)
        return metrics

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # ---------------------------------------------------------------- state

    def save_state(self, path: str | os.PathLike) -> Path:
        """The whole critic (head included) + optimizer state, atomically."""
        return ckpt.save_training_state(
            path, self.model, self.optimizer, self.param_names, self.step, info=INFO
        )

    def load_state(self, path: str | os.PathLike, optimizer: bool = True) -> None:
        """Restore a ``save_state`` checkpoint; continuation is bit-identical. Everything is
        checked before anything changes. (An HF directory is not a critic checkpoint: build
        the critic with ``critic_from_pretrained`` or use ``load_hf_trunk``.)"""
        tensors, opt_tensors, meta = ckpt.read_training_state(path)
        ckpt.check_kind(meta, ckpt.KIND_MODEL)
        ckpt.check_info(meta, INFO)
        ckpt.check_model_tensors(self.model, tensors)
        opt_state = (
            ckpt.optimizer_state_dict(meta, opt_tensors, self.param_names) if optimizer else None
        )
        with torch.no_grad():
            ckpt.restore_model(self.model, tensors, meta["aliases"])
        self.optimizer = build_adamw(self.params)
        if opt_state is not None:
            self.optimizer.load_state_dict(opt_state)
        self.step = int(meta["step"]) if optimizer else 0


def _per_token(name: str, given: Sequence[torch.Tensor], datums: Sequence[Datum]) -> list:
    """One finite float32 ``[len(datum)]`` CPU tensor per datum, or an InputError naming
    ``name[index]``."""
    if isinstance(given, str | bytes) or not isinstance(given, Sequence):
        raise InputError(f"{name}: expected a list with one tensor per datum")
    if len(given) != len(datums):
        raise InputError(f"{name}: {len(given)} entries for {len(datums)} datums")
    out = []
    for i, (v, d) in enumerate(zip(given, datums, strict=True)):
        try:
            t = torch.as_tensor(v.detach() if isinstance(v, torch.Tensor) else v)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InputError(f"{name}[{i}]: cannot be read as numbers ({exc})") from None
        if t.dtype == torch.bool or t.is_complex():
            raise InputError(f"{name}[{i}]: expected real numbers, got dtype {t.dtype}")
        if t.dim() != 1:
            raise InputError(f"{name}[{i}]: expected a 1-D tensor, got shape {tuple(t.shape)}")
        if t.numel() != len(d):
            raise InputError(f"{name}[{i}]: {t.numel()} values for a datum of {len(d)} tokens")
        t = t.to(device="cpu", dtype=torch.float32)
        if not bool(torch.isfinite(t).all()):
            raise InputError(f"{name}[{i}]: holds NaN or inf")
        out.append(t.clone())
    return out
