"""Whole-request validation, run before any compute or state change.

Every error names the datum index and the field, so a client can fix its request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from furlong.errors import InputError
from furlong.train.objectives import OBJECTIVES, Objective, get_objective
from furlong.types import Datum


def _check_ids(i: int, name: str, ids: torch.Tensor, vocab_size: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise InputError(f"datum {i}: {name} holds token id {bad}, outside [0, {vocab_size})")


def validate_batch(
    datums: Sequence[Datum],
    loss_fn: object,
    loss_fn_config: Mapping[str, object] | None,
    vocab_size: int,
    max_length: int | None = None,
    objectives: Mapping[str, Objective] = OBJECTIVES,
) -> tuple[Objective, dict[str, float]]:
    """Check a whole request; return the objective (one of ``objectives``: the model's head's)
    and its resolved config."""
    objective = get_objective(loss_fn, objectives)
    config = objective.resolve_config(loss_fn_config)
    if isinstance(datums, Datum) or not isinstance(datums, Sequence) or not datums:
        raise InputError("datums: expected a non-empty list of Datum")
    for i, d in enumerate(datums):
        if not isinstance(d, Datum):
            raise InputError(f"datum {i}: expected a Datum, got {type(d).__name__}")
        n = len(d)
        if n == 0:
            raise InputError(f"datum {i}: model_input is empty")
        if max_length is not None and n > max_length:
            raise InputError(
                f"datum {i}: model_input has {n} tokens, more than the model's {max_length}"
            )
        _check_ids(i, "model_input", d.model_input, vocab_size)
        targets = d.loss_fn_inputs.get("target_tokens")
        if targets is None:
            raise InputError(f"datum {i}: loss_fn_inputs['target_tokens'] is missing")
        ok_shape = targets.dim() == 1 or (objective.top_k_targets and targets.dim() == 2)
        if not ok_shape or targets.shape[0] != n or (targets.dim() == 2 and targets.shape[1] < 1):
            want = f"({n},)" + (f" or ({n}, K)" if objective.top_k_targets else "")
            raise InputError(
                f"datum {i}: loss_fn_inputs['target_tokens'] has shape {tuple(targets.shape)}, "
                f"expected {want} for {objective.name} (len(model_input) = {n})"
            )
        _check_ids(i, "loss_fn_inputs['target_tokens']", targets, vocab_size)
        for key in objective.inputs:
            value = d.loss_fn_inputs.get(key)
            if value is None:
                raise InputError(
                    f"datum {i}: loss_fn_inputs[{key!r}] is missing (required by {objective.name})"
                )
            if value.shape != targets.shape:
                raise InputError(
                    f"datum {i}: loss_fn_inputs[{key!r}] has shape {tuple(value.shape)}, "
                    f"expected {tuple(targets.shape)} (the shape of target_tokens)"
                )
            if not bool(torch.isfinite(value).all()):
                raise InputError(f"datum {i}: loss_fn_inputs[{key!r}] holds NaN or inf")
    return objective, config
