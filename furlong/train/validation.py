"""Whole-request validation, run before any compute or state change, and the check of a
pass's loss after it.

Every error names the datum index and the field, so a client can fix its request.
``check_request`` needs no model (the objective, its config, every input's shape and range):
the Tinker service runs it at submission. ``validate_batch`` adds the model's vocabulary and
context. ``check_losses`` refuses a pass whose loss came out non-finite.

Input ranges. float32 overflows at about 3.4e38 (~2**128), and every loss term is an input
times a factor the model supplies (``lp``, the ratio ``exp(lp - s)``, ``(lp - s)**2``), summed
over a datum's tokens:

- ``logprobs`` (the sampler's) are log-probabilities: ``<= 0``, and ``>= LOGPROB_FLOOR``, the
  log of the smallest positive float64 (~ -744.4): a sampler cannot have drawn a token whose
  probability no float format holds, so a lower value is a sentinel (-1e30, -FLT_MAX), not a
  log-prob. Legit values sit far above it (a float32 sampler cannot go below ln 2**-149 ~ -103.3).
- ``advantages``, ``weights`` (and a critic's ``returns``, ``old_values``) have ``|x| <=
  MAX_MAGNITUDE`` = 1e6 < 2**20. A datum sums at most 2**24 tokens (beyond any context window),
  which leaves a factor of 2**84 (~1.9e25) before a datum's sum overflows: any log-prob, any
  ``(lp - s)**2`` within the floor, and any ratio up to e**58. Legit values are orders of
  magnitude smaller (normalized advantages, 0/1 or 1/N weights, custom-loss gradients).
- A ratio can still overflow on legit inputs (``exp(lp - s)`` passes float32 when the trainer's
  log-prob is ~88.7 above the sampler's), so the loss is checked after the pass as well.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from furlong.errors import InputError
from furlong.train.objectives import OBJECTIVES, Objective, get_objective
from furlong.types import Datum

LOGPROB_FLOOR = -745.0  # below ln(smallest positive float64) ~ -744.44: not a log-probability
MAX_MAGNITUDE = 1e6  # |advantages|, |weights|, |returns|, |old_values|: see the module doc
BOUNDED = ("advantages", "weights", "returns", "old_values")


def _check_ids(i: int, name: str, ids: torch.Tensor, vocab_size: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise InputError(f"datum {i}: {name} holds token id {bad}, outside [0, {vocab_size})")


def _first(i: int, key: str, value: torch.Tensor, bad: torch.Tensor) -> str:
    """``datum i: loss_fn_inputs['key'][j] = v`` for the first element where ``bad`` holds."""
    where = torch.nonzero(bad)[0].tolist()
    return f"datum {i}: loss_fn_inputs[{key!r}]{where} = {float(value[tuple(where)])}"


def _check_values(i: int, key: str, value: torch.Tensor) -> None:
    """Finite everywhere, and within the field's range (see the module doc)."""
    finite = torch.isfinite(value)
    if not bool(finite.all()):
        where = torch.nonzero(~finite)[0].tolist()
        raise InputError(f"datum {i}: loss_fn_inputs[{key!r}] holds NaN or inf (at {where})")
    if key == "logprobs":
        if bool((value > 0).any()):
            raise InputError(f"{_first(i, key, value, value > 0)}: a log-probability must be <= 0")
        if bool((value < LOGPROB_FLOOR).any()):
            raise InputError(
                f"{_first(i, key, value, value < LOGPROB_FLOOR)}: below {LOGPROB_FLOOR}, the log "
                "of a probability no sampler can have drawn (not a log-probability)"
            )
    elif key in BOUNDED and bool((value.abs() > MAX_MAGNITUDE).any()):
        raise InputError(
            f"{_first(i, key, value, value.abs() > MAX_MAGNITUDE)}: |{key}| must be <= "
            f"{MAX_MAGNITUDE:g} so the float32 loss cannot overflow"
        )


def check_request(
    datums: Sequence[Datum],
    loss_fn: object,
    loss_fn_config: Mapping[str, object] | None,
    objectives: Mapping[str, Objective] = OBJECTIVES,
) -> tuple[Objective, dict[str, float]]:
    """Everything about a request that needs no model; return the objective and its config."""
    return validate_batch(datums, loss_fn, loss_fn_config, None, None, objectives)


def validate_batch(
    datums: Sequence[Datum],
    loss_fn: object,
    loss_fn_config: Mapping[str, object] | None,
    vocab_size: int | None,
    max_length: int | None = None,
    objectives: Mapping[str, Objective] = OBJECTIVES,
) -> tuple[Objective, dict[str, float]]:
    """Check a whole request; return the objective (one of ``objectives``: the model's head's)
    and its resolved config. ``vocab_size`` / ``max_length`` None: not checked."""
    objective = get_objective(loss_fn, objectives)
    config = objective.resolve_config(loss_fn_config)
    if isinstance(datums, Datum) or not isinstance(datums, Sequence) or not datums:
        raise InputError("datums: expected a non-empty list of Datum")
    for i, d in enumerate(datums):
        _check_datum(i, d, objective, vocab_size, max_length)
    return objective, config


def _check_datum(
    i: int, d: object, objective: Objective, vocab_size: int | None, max_length: int | None
) -> None:
    if not isinstance(d, Datum):
        raise InputError(f"datum {i}: expected a Datum, got {type(d).__name__}")
    n = len(d)
    if n == 0:
        raise InputError(f"datum {i}: model_input is empty")
    if max_length is not None and n > max_length:
        raise InputError(
            f"datum {i}: model_input has {n} tokens, more than the model's {max_length}"
        )
    if vocab_size is not None:
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
    if vocab_size is not None:
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
        _check_values(i, key, value)
    if "sequence_ratio_mask" in objective.inputs and not bool(
        (d.loss_fn_inputs["sequence_ratio_mask"] != 0).any()  # present: checked above
    ):
        raise InputError(
            f"datum {i}: loss_fn_inputs['sequence_ratio_mask'] marks no token; "
            f"{objective.name}'s sequence ratio is a mean over the marked (nonzero) tokens"
        )


def check_losses(loss_fn: str, outputs: Sequence[Mapping[str, torch.Tensor]], total: float) -> None:
    """Refuse a pass whose loss is not finite (a user error: the inputs made float32 overflow),
    naming the first such datum. The caller drops what the pass did (its gradients)."""
    if math.isfinite(total):
        return
    why = (
        "float32 overflowed: a ratio exp(lp - logprobs) passes 3.4e38 when the trainer's "
        "log-prob is ~88.7 above the sampler's, or the inputs are too large; nothing was applied"
    )
    for i, out in enumerate(outputs):
        loss = float(out["loss"])
        if not math.isfinite(loss):
            raise InputError(f"datum {i}: the {loss_fn} loss is {loss} ({why})")
    raise InputError(f"loss:sum: the {loss_fn} losses of the datums sum to {total} ({why})")
