"""The rollout -> trainer codec: a list of ``Sample`` as one safetensors payload.

Tensors are stored per sample as ``<field>.<i>`` (a ``SamplingMask`` as
``sampling_mask.ids.<i>`` int32 and ``sampling_mask.offsets.<i>`` int64); scalars and null
markers go in the header metadata. Only the fields in the allowlist travel: the optional
ones (``sampling_mask``, ``routed_experts``) are opt-in, so a default payload is byte for
byte what it would be without them. Decoding is strict: the payload's field list must equal
the decoder's, every tensor must be referenced by a requested field and have its dtype.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch
from safetensors.torch import load, save

from furlong.errors import InputError
from furlong.rollout.sample import Sample
from furlong.rollout.sampling_mask import SamplingMask

DEFAULT_FIELDS = ("tokens", "loss_mask", "rollout_logprobs", "reward", "weight_version")
OPTIONAL_FIELDS = ("sampling_mask", "routed_experts")
_TENSOR_DTYPES = {
    "tokens": torch.int64,
    "loss_mask": torch.float32,
    "rollout_logprobs": torch.float32,
    "routed_experts": torch.int32,
}
_SCALARS = ("reward", "weight_version")
FORMAT = "furlong-samples-v1"


def _check_fields(fields: Sequence[str]) -> tuple[str, ...]:
    fields = tuple(fields)
    unknown = [f for f in fields if f not in DEFAULT_FIELDS + OPTIONAL_FIELDS]
    if unknown:
        raise InputError(
            f"codec fields: unknown {unknown}; known {DEFAULT_FIELDS + OPTIONAL_FIELDS}"
        )
    missing = [f for f in ("tokens", "loss_mask", "rollout_logprobs") if f not in fields]
    if missing:
        raise InputError(f"codec fields: {missing} are required")
    return fields


def encode_samples(samples: Sequence[Sample], fields: Sequence[str] = DEFAULT_FIELDS) -> bytes:
    fields = _check_fields(fields)
    tensors: dict[str, torch.Tensor] = {}
    nulls: dict[str, list[int]] = {}
    meta: dict[str, object] = {"format": FORMAT, "fields": list(fields), "count": len(samples)}
    meta["response_length"] = [s.response_length for s in samples]
    for name in fields:
        if name in _SCALARS:
            meta[name] = [getattr(s, name) for s in samples]
            continue
        for i, s in enumerate(samples):
            value = getattr(s, name)
            if value is None:
                nulls.setdefault(name, []).append(i)
            elif isinstance(value, SamplingMask):
                ids, offsets = value.tensors()
                tensors[f"{name}.ids.{i}"], tensors[f"{name}.offsets.{i}"] = ids, offsets
            else:
                tensors[f"{name}.{i}"] = value.contiguous()
    meta["nulls"] = nulls
    return save(tensors, metadata={"furlong": json.dumps(meta, sort_keys=True)})


def _take(tensors: dict, key: str, dtype: torch.dtype, used: set[str]) -> torch.Tensor:
    if key not in tensors:
        raise InputError(f"codec: payload misses tensor {key!r}")
    t = tensors[key]
    if t.dtype != dtype:
        raise InputError(f"codec: tensor {key!r} has dtype {t.dtype}, expected {dtype}")
    used.add(key)
    return t


def decode_samples(payload: bytes, fields: Sequence[str] = DEFAULT_FIELDS) -> list[Sample]:
    """Samples from ``payload``; any malformed or corrupted payload raises InputError
    (a ValueError), never another exception."""
    fields = _check_fields(fields)
    try:
        return _decode(payload, fields)
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - corruption may surface anywhere in the walk
        raise InputError(f"codec: malformed payload ({type(exc).__name__}: {exc})") from None


def _decode(payload: bytes, fields: tuple[str, ...]) -> list[Sample]:
    try:
        tensors = load(payload)
        header_len = int.from_bytes(payload[:8], "little")  # safetensors: u64 size, JSON header
        header = json.loads(payload[8 : 8 + header_len])
    except Exception as exc:  # noqa: BLE001 - any parse failure is a malformed payload
        raise InputError(f"codec: payload is not safetensors ({exc})") from None
    meta = json.loads(header.get("__metadata__", {}).get("furlong", "{}"))
    if meta.get("format") != FORMAT:
        raise InputError(f"codec: not a {FORMAT} payload")
    if tuple(meta["fields"]) != fields:
        raise InputError(
            f"codec: payload carries fields {meta['fields']}, the decoder expects {list(fields)} "
            "(encoder and decoder allowlists must match)"
        )
    used: set[str] = set()
    nulls = {k: set(v) for k, v in meta["nulls"].items()}
    samples = []
    for i in range(meta["count"]):
        kwargs: dict[str, object] = {"response_length": meta["response_length"][i]}
        for name in fields:
            if name in _SCALARS:
                kwargs[name] = meta[name][i]
            elif i in nulls.get(name, ()):
                kwargs[name] = None
            elif name == "sampling_mask":
                ids = _take(tensors, f"{name}.ids.{i}", torch.int32, used)
                offsets = _take(tensors, f"{name}.offsets.{i}", torch.int64, used)
                kwargs[name] = SamplingMask(ids, offsets)
            else:
                kwargs[name] = _take(tensors, f"{name}.{i}", _TENSOR_DTYPES[name], used)
        samples.append(Sample(**kwargs))  # type: ignore[arg-type]
    extra = sorted(set(tensors) - used)
    if extra:
        raise InputError(f"codec: payload holds tensors no requested field references: {extra[:4]}")
    return samples
