"""Training samples over ``POST /sessions/{id}/samples``: the rollout codec's safetensors
payload (``Accept: application/x-furlong-samples``) or JSON, both under the codec's allowlist.

The receiver opts in to optional fields with ``?fields=sampling_mask,routed_experts``; the
server sends those plus any optional field the sample carries (:func:`payload_fields`), so a
receiver that did not opt in fails at decode instead of silently losing data. In JSON an
optional field is a key only when it travels: ``routed_experts`` flat with its shape
(``[len(tokens) - 1, layers, top_k]``), a sampling mask as its CSR ``ids`` / ``offsets``, or
null. float32 values survive the JSON round trip exactly (each is printed as the double it
widens to).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from furlong.errors import InputError
from furlong.rollout.codec import (
    DEFAULT_FIELDS,
    MEDIA_TYPE,
    OPTIONAL_FIELDS,
    check_allowlist,
    opt_in,
)
from furlong.rollout.sample import Sample
from furlong.rollout.sampling_mask import SamplingMask


def parse_fields(query: str) -> tuple[str, ...]:
    """The allowlist a ``?fields=a,b`` query asks for (the default fields always travel)."""
    try:
        return opt_in(*(name.strip() for name in query.split(",") if name.strip()))
    except InputError as exc:
        raise InputError(f"fields: {exc}") from None


def wants_codec(accept: str) -> bool:
    """Whether an ``Accept`` header asks for the codec payload rather than JSON."""
    return any(part.split(";")[0].strip() == MEDIA_TYPE for part in accept.split(","))


def sample_to_json(sample: Sample, fields: Sequence[str] = DEFAULT_FIELDS) -> dict[str, Any]:
    """The sample's ``fields`` as JSON (an optional field outside them is left out, as the
    codec's encoder does)."""
    out: dict[str, Any] = {
        "tokens": sample.tokens.tolist(),
        "prompt_length": sample.prompt_length,
        "response_length": sample.response_length,
        "loss_mask": sample.loss_mask.tolist(),
        "rollout_logprobs": sample.rollout_logprobs.tolist(),
        "reward": sample.reward,
        "weight_version": sample.weight_version,
    }
    mask, rows = sample.sampling_mask, sample.routed_experts
    if "sampling_mask" in opt_in(*fields):
        out["sampling_mask"] = None if mask is None else _csr(mask)
    if "routed_experts" in opt_in(*fields):
        out["routed_experts"] = (
            None if rows is None else {"shape": list(rows.shape), "data": rows.reshape(-1).tolist()}
        )
    return out


def _csr(mask: SamplingMask) -> dict[str, list[int]]:
    ids, offsets = mask.tensors()
    return {"ids": ids.tolist(), "offsets": offsets.tolist()}


def _tensor(data: dict, name: str, dtype: torch.dtype) -> torch.Tensor:
    try:
        return torch.tensor(data[name], dtype=dtype)
    except KeyError:
        raise InputError(f"sample.{name}: missing") from None
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InputError(f"sample.{name}: not a list of numbers ({exc})") from None


def sample_from_json(data: dict[str, Any], fields: Sequence[str] = DEFAULT_FIELDS) -> Sample:
    """The ``Sample`` a ``/samples`` response carries (validated like any sample); its optional
    keys must be exactly the optional ``fields`` asked for, as in the codec's decoder."""
    if not isinstance(data, dict):
        raise InputError("sample: expected an object")
    check_allowlist((*DEFAULT_FIELDS, *(f for f in OPTIONAL_FIELDS if f in data)), fields)
    mask = None
    if data.get("sampling_mask") is not None:
        m = data["sampling_mask"]
        mask = SamplingMask(_tensor(m, "ids", torch.int64), _tensor(m, "offsets", torch.int64))
    rows = None
    if data.get("routed_experts") is not None:
        r = data["routed_experts"]
        flat = _tensor(r, "data", torch.int32)
        try:
            rows = flat.view(*r["shape"])
        except (KeyError, TypeError, RuntimeError) as exc:
            raise InputError(f"sample.routed_experts.shape: does not fit ({exc})") from None
    return Sample(
        tokens=_tensor(data, "tokens", torch.int64),
        response_length=int(data.get("response_length", -1)),
        loss_mask=_tensor(data, "loss_mask", torch.float32),
        rollout_logprobs=_tensor(data, "rollout_logprobs", torch.float32),
        reward=data.get("reward"),
        sampling_mask=mask,
        routed_experts=rows,
        weight_version=data.get("weight_version"),
    )
