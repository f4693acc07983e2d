"""Training samples as JSON (``POST /sessions/{id}/samples``) and back to tensors.

``routed_experts`` travels flat with its shape (``[len(tokens) - 1, layers, top_k]``), a
sampling mask as its CSR ``ids`` / ``offsets``. float32 values survive the JSON round trip
exactly (each is printed as the double it widens to).
"""

from __future__ import annotations

from typing import Any

import torch

from furlong.errors import InputError
from furlong.rollout.sample import Sample
from furlong.rollout.sampling_mask import SamplingMask


def sample_to_json(sample: Sample) -> dict[str, Any]:
    mask, rows = sample.sampling_mask, sample.routed_experts
    return {
        "tokens": sample.tokens.tolist(),
        "prompt_length": sample.prompt_length,
        "response_length": sample.response_length,
        "loss_mask": sample.loss_mask.tolist(),
        "rollout_logprobs": sample.rollout_logprobs.tolist(),
        "reward": sample.reward,
        "weight_version": sample.weight_version,
        "sampling_mask": None
        if mask is None
        else {"ids": mask.tensors()[0].tolist(), "offsets": mask.tensors()[1].tolist()},
        "routed_experts": None
        if rows is None
        else {"shape": list(rows.shape), "data": rows.reshape(-1).tolist()},
    }


def _tensor(data: dict, name: str, dtype: torch.dtype) -> torch.Tensor:
    try:
        return torch.tensor(data[name], dtype=dtype)
    except KeyError:
        raise InputError(f"sample.{name}: missing") from None
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InputError(f"sample.{name}: not a list of numbers ({exc})") from None


def sample_from_json(data: dict[str, Any]) -> Sample:
    """The ``Sample`` a ``/samples`` response carries (validated like any sample)."""
    if not isinstance(data, dict):
        raise InputError("sample: expected an object")
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
