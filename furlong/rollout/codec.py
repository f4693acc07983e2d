"""The rollout -> trainer codec: a list of ``Sample`` as one safetensors payload.

Tensors are stored per sample as ``<field>.<i>`` (a ``SamplingMask`` as
``sampling_mask.ids.<i>`` int32 and ``sampling_mask.offsets.<i>`` int64); scalars and null
markers go in the header metadata. Only the fields in the allowlist travel: the optional
ones (``sampling_mask``, ``routed_experts``) are opt-in, so a default payload is byte for
byte what it would be without them. Decoding is strict: the payload's field list must equal
the decoder's, every tensor must be referenced by a requested field and have its dtype.

On a transport the receiver states its allowlist (:func:`opt_in`) and the sender encodes
:func:`payload_fields`: that allowlist plus every optional field its samples carry, so data
is never dropped on the way and a receiver that did not opt in fails at decode. Generation
results (Ray rollout engines -> the loop) travel as samples too (:func:`encode_results`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, get_args

import torch
from safetensors.torch import load, save

from furlong.errors import InputError
from furlong.rollout.base import FinishReason, GenerateResult
from furlong.rollout.sample import Sample
from furlong.rollout.sampling_mask import SamplingMask

DEFAULT_FIELDS = ("tokens", "loss_mask", "rollout_logprobs", "reward", "weight_version")
OPTIONAL_FIELDS = ("sampling_mask", "routed_experts")
MEDIA_TYPE = "application/x-furlong-samples"  # a payload over HTTP
_TENSOR_DTYPES = {
    "tokens": torch.int64,
    "loss_mask": torch.float32,
    "rollout_logprobs": torch.float32,
    "routed_experts": torch.int32,
}
_SCALARS = ("reward", "weight_version")
FORMAT = "furlong-samples-v1"
# what a GenerateResult carries beyond a sample; refused rather than dropped
_RESULT_ONLY = ("prompt_logprobs", "prompt_top_logprobs", "prompt_target_logprobs", "top_logprobs")
T = TypeVar("T")


def _check_fields(fields: Iterable[str]) -> tuple[str, ...]:
    fields = tuple(fields)
    known = DEFAULT_FIELDS + OPTIONAL_FIELDS
    unknown = [f for f in fields if f not in known]
    if unknown:
        raise InputError(f"codec fields: unknown {unknown}; known {known}")
    missing = [f for f in ("tokens", "loss_mask", "rollout_logprobs") if f not in fields]
    if missing:
        raise InputError(f"codec fields: {missing} are required")
    return tuple(f for f in known if f in fields)  # one order: the same set, the same list


def opt_in(*optional: str) -> tuple[str, ...]:
    """A receiver's allowlist: the default fields plus ``optional`` (names may repeat)."""
    return _check_fields((*DEFAULT_FIELDS, *optional))


def payload_fields(
    items: Sequence[Sample | GenerateResult], wanted: Sequence[str]
) -> tuple[str, ...]:
    """What a sender encodes for a receiver that asked for ``wanted``: those fields plus every
    optional field ``items`` carry. Nothing is dropped silently; the strict decode of a
    receiver that did not opt in refuses the extra field."""
    carried = [f for f in OPTIONAL_FIELDS if any(getattr(x, f) is not None for x in items)]
    return _check_fields((*wanted, *carried))


def check_allowlist(carried: Iterable[str], expected: Iterable[str]) -> None:
    """The one matching rule of every decoder: the payload's fields are the receiver's."""
    carried, expected = _check_fields(carried), _check_fields(expected)
    if carried != expected:
        extra = [f for f in carried if f not in expected]
        missing = [f for f in expected if f not in carried]
        raise InputError(
            f"codec: payload carries fields {extra} the receiver did not opt in to and lacks "
            f"{missing} it asked for (encoder and decoder allowlists must match)"
        )


def encode_samples(samples: Sequence[Sample], fields: Sequence[str] = DEFAULT_FIELDS) -> bytes:
    return _encode(samples, _check_fields(fields), {})


def _encode(samples: Sequence[Sample], fields: tuple[str, ...], extra: dict) -> bytes:
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
    return save(tensors, metadata={"furlong": json.dumps(meta | extra, sort_keys=True)})


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
    return _strict(lambda: _decode(payload, fields)[0])


def _strict(decode: Callable[[], T]) -> T:
    try:
        return decode()
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - corruption may surface anywhere in the walk
        raise InputError(f"codec: malformed payload ({type(exc).__name__}: {exc})") from None


def _decode(payload: bytes, fields: tuple[str, ...]) -> tuple[list[Sample], dict[str, Any]]:
    try:
        tensors = load(payload)
        header_len = int.from_bytes(payload[:8], "little")  # safetensors: u64 size, JSON header
        header = json.loads(payload[8 : 8 + header_len])
    except Exception as exc:  # noqa: BLE001 - any parse failure is a malformed payload
        raise InputError(f"codec: payload is not safetensors ({exc})") from None
    meta = json.loads(header.get("__metadata__", {}).get("furlong", "{}"))
    if meta.get("format") != FORMAT:
        raise InputError(f"codec: not a {FORMAT} payload")
    check_allowlist(meta["fields"], fields)
    used: set[str] = set()
    nulls = {k: set(v) for k, v in meta["nulls"].items()}
    samples = []
    for i in range(meta["count"]):
        kwargs: dict[str, Any] = {"response_length": meta["response_length"][i]}
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
        samples.append(Sample(**kwargs))  # Sample checks the fields
    extra = sorted(set(tensors) - used)
    if extra:
        raise InputError(f"codec: payload holds tensors no requested field references: {extra[:4]}")
    return samples, meta


# ---------------------------------------------------------------- generation results


def encode_results(
    results: Sequence[GenerateResult], fields: Sequence[str] = DEFAULT_FIELDS
) -> bytes:
    """Results as samples (prompt + output tokens, loss mask 1, the sampler's log-probs as
    float32) with each request's id and finish reason in the header. A result that carries
    what a sample cannot hold (prompt or top log-probs, routed-expert rows from an offset) is
    refused rather than cut down."""
    samples = [_result_sample(i, r) for i, r in enumerate(results)]
    extra = {
        "request_id": [r.request_id for r in results],
        "finish_reason": [r.finish_reason for r in results],
    }
    return _encode(samples, _check_fields(fields), {"results": extra})


def _result_sample(i: int, r: GenerateResult) -> Sample:
    for name in _RESULT_ONLY:
        if getattr(r, name) is not None:
            raise InputError(f"results[{i}].{name}: the samples codec does not carry it")
    if r.routed_experts is not None and r.routed_experts_start:
        raise InputError(
            f"results[{i}].routed_experts_start: {r.routed_experts_start}; the samples codec "
            "carries rows from position 0 only"
        )
    return Sample(
        tokens=torch.tensor([*r.prompt_ids, *r.output_ids], dtype=torch.int64),
        response_length=len(r.output_ids),
        loss_mask=torch.ones(len(r.output_ids)),
        rollout_logprobs=torch.tensor(r.output_logprobs, dtype=torch.float32),
        sampling_mask=r.sampling_mask,
        routed_experts=r.routed_experts,
        weight_version=r.weight_version,
    )


def decode_results(payload: bytes, fields: Sequence[str] = DEFAULT_FIELDS) -> list[GenerateResult]:
    """The results :func:`encode_results` wrote; strict like :func:`decode_samples`."""
    fields = _check_fields(fields)
    return _strict(lambda: _results(*_decode(payload, fields)))


def _results(samples: list[Sample], meta: dict[str, Any]) -> list[GenerateResult]:
    extra = meta.get("results")
    if not isinstance(extra, dict):
        raise InputError("codec: not a generation results payload (no request ids)")
    ids, reasons = extra["request_id"], extra["finish_reason"]
    if len(ids) != len(samples) or len(reasons) != len(samples):
        raise InputError("codec: request ids / finish reasons do not match the samples")
    out = []
    for s, rid, reason in zip(samples, ids, reasons, strict=True):
        if reason not in get_args(FinishReason) or not isinstance(rid, int | str):
            raise InputError(f"codec: bad request id {rid!r} or finish reason {reason!r}")
        if not isinstance(s.weight_version, int):  # a result names its weights (fields has it)
            raise InputError(f"codec: bad weight version {s.weight_version!r} for a result")
        out.append(
            GenerateResult(
                request_id=rid,
                prompt_ids=s.tokens[: s.prompt_length].tolist(),
                output_ids=s.response.tolist(),
                output_logprobs=s.rollout_logprobs.tolist(),
                finish_reason=reason,
                sampling_mask=s.sampling_mask,
                weight_version=s.weight_version,
                routed_experts=s.routed_experts,
            )
        )
    return out
