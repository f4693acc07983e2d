"""SGLang's native ``/generate`` wire format, both ways.

One module holds the mapping so the server (``furlong rollout-server``) and the client adapter
(:class:`~furlong.rollout.sglang_client.SGLangClient`) cannot drift apart. Field names follow
SGLang (``sampling_params.max_new_tokens``, ``sampling_seed``, ``return_logprob``,
``return_routed_experts``, ``routed_experts_start_len``; log-probs as ``[logprob, token_id,
text]`` triplets; routed experts as base64 of int32 ``[tokens - 1 - start, layers, top_k]``).
furlong adds one opt-in field: ``return_sampling_mask`` → ``meta_info.sampling_mask`` =
``{"ids": base64 int32, "offsets": base64 int64}`` (the CSR kept sets).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from furlong.errors import InputError
from furlong.rollout.base import GenerateResult
from furlong.rollout.sampling import SamplingParams, check_seed
from furlong.rollout.sampling_mask import SamplingMask

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
_ALL_TOP_K = 1 << 30  # SGLang's "no top-k"
# Accepted only at their no-op value: they change the logits, which replay could not follow.
_NEUTRAL = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "logit_bias": None,
}
_TEXT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
_SAMPLING_KEYS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "sampling_seed",
}


# ------------------------------------------------------------------ scalars


def parse_version(value: Any) -> int | None:
    """furlong's integer weight version from SGLang's string field (None if not an integer,
    e.g. a real SGLang server's ``"default"``)."""
    text = str(value)
    return int(text) if text.lstrip("-").isdigit() else None


# ------------------------------------------------------------------ tensors


def encode_array(t: torch.Tensor, dtype: str) -> str:
    return base64.b64encode(t.numpy().astype(dtype).tobytes()).decode("ascii")


def decode_array(data: str, dtype: str, field: str) -> np.ndarray:
    try:
        return np.frombuffer(base64.b64decode(data.encode("ascii"), validate=True), dtype=dtype)
    except (ValueError, AttributeError) as e:
        raise InputError(f"{field}: not base64 of {dtype}: {e}") from e


# ------------------------------------------------------------------ request


def request_body(prompt: list[int], params: SamplingParams, request_id: str | None = None) -> dict:
    """The ``/generate`` body for one request (client side)."""
    sp: dict[str, Any] = {
        "max_new_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "min_p": params.min_p,
        "stop": list(params.stop),
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if params.stop_token_ids is not None:  # exactly these ids stop (EOS only when listed)
        sp["stop_token_ids"] = list(params.stop_token_ids)
        sp["ignore_eos"] = True
    if params.seed is not None:
        sp["sampling_seed"] = params.seed
    body: dict[str, Any] = {
        "input_ids": prompt,
        "sampling_params": sp,
        "return_logprob": True,
        "logprob_start_len": 0 if params.prompt_logprobs else -1,
        "top_logprobs_num": params.top_logprobs,
    }
    if params.return_routed_experts:
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = params.routed_experts_start
    if params.return_sampling_mask:
        body["return_sampling_mask"] = True
    if request_id is not None:
        body["rid"] = request_id
    return body


def sampling_params(
    sp: Any, top: Mapping[str, Any], eos_ids: Iterable[int], where: str
) -> SamplingParams:
    """``SamplingParams`` from one item's ``sampling_params`` dict and the request's top-level
    options (server side). Unsupported keys are rejected by name; every value is type-checked
    here, before SGLang's conventions are mapped (``top_k`` -1, tiny temperatures)."""
    if sp is None:
        sp = {}
    if not isinstance(sp, Mapping):
        raise InputError(f"{where}: expected an object, got {type(sp).__name__}")
    for key, value in sp.items():
        if key in _NEUTRAL:
            if value is not None and (isinstance(value, bool) or value != _NEUTRAL[key]):
                raise InputError(f"{where}.{key}: not supported (only {_NEUTRAL[key]!r})")
        elif key in _TEXT_ONLY:
            flag(value, f"{where}.{key}")
        elif key not in _SAMPLING_KEYS:
            raise InputError(f"{where}.{key}: unknown sampling parameter")
    temperature = number(sp.get("temperature"), f"{where}.temperature", 1.0)
    top_k = integer(sp.get("top_k"), f"{where}.top_k", -1)
    seed = sp.get("sampling_seed")
    stop = [] if sp.get("stop") is None else sp["stop"]
    ids = _token_ids(sp.get("stop_token_ids"), f"{where}.stop_token_ids")
    stop_ids: tuple[int, ...] | None
    if flag(sp.get("ignore_eos"), f"{where}.ignore_eos"):
        stop_ids = tuple(ids or ())
    else:
        stop_ids = None if ids is None else tuple(sorted({*ids, *eos_ids}))
    fields: dict[str, Any] = dict(  # checked by SamplingParams, inside the try below
        max_tokens=integer(
            sp.get("max_new_tokens"), f"{where}.max_new_tokens", DEFAULT_MAX_NEW_TOKENS, 1
        ),
        temperature=0.0 if temperature < 1e-6 else temperature,
        top_k=0 if top_k < 0 or top_k >= _ALL_TOP_K else top_k,
        top_p=number(sp.get("top_p"), f"{where}.top_p", 1.0),
        min_p=number(sp.get("min_p"), f"{where}.min_p", 0.0),
        seed=None if seed is None else check_seed(seed, f"{where}.sampling_seed"),
        stop_token_ids=stop_ids,
        stop=(stop,) if isinstance(stop, str) else stop,
        return_sampling_mask=flag(top.get("return_sampling_mask"), "return_sampling_mask"),
        prompt_logprobs=flag(top.get("return_logprob"), "return_logprob")
        and top["logprob_start_len"] >= 0,
        top_logprobs=integer(top.get("top_logprobs_num"), "top_logprobs_num", 0, 0),
        return_routed_experts=flag(top.get("return_routed_experts"), "return_routed_experts"),
        routed_experts_start=integer(
            top.get("routed_experts_start_len"), "routed_experts_start_len", 0, 0
        ),
    )
    try:
        return SamplingParams(**fields)
    except InputError as e:  # "sampling_params.top_p: ..." -> "sampling_params[2].top_p: ..."
        raise InputError(f"{where}{str(e).removeprefix('sampling_params')}") from e


def number(value: Any, field: str, default: float) -> float:
    """A finite JSON number (``null``: the default)."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InputError(f"{field}: expected a finite number, got {value!r}")
    return float(value)


def integer(value: Any, field: str, default: int, minimum: int | None = None) -> int:
    """A JSON integer (``null``: the default); ``3.0`` is refused like SGLang's int fields."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{field}: expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise InputError(f"{field}: must be >= {minimum}, got {value}")
    return value


def flag(value: Any, field: str) -> bool:
    """A JSON bool (``null``: false); ``"false"`` must not read as true."""
    if value is not None and not isinstance(value, bool):
        raise InputError(f"{field}: expected a bool, got {value!r}")
    return bool(value)


def _token_ids(value: Any, field: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise InputError(f"{field}: expected a list of integers, got {value!r}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise InputError(f"{field}[{i}]: expected a token id >= 0, got {t!r}")
    return value


# ------------------------------------------------------------------ response


def response_body(
    result: GenerateResult, text: str, stop_ids: frozenset[int], logprob_start: int, latency: float
) -> dict:
    """One ``/generate`` response object (server side)."""
    meta: dict[str, Any] = {
        "id": str(result.request_id),
        "finish_reason": _finish_reason(result, text, stop_ids),
        "prompt_tokens": len(result.prompt_ids),
        "completion_tokens": len(result.output_ids),
        "cached_tokens": 0,
        "weight_version": str(result.weight_version),
        "e2e_latency": latency,
        "output_token_logprobs": [
            [lp, t, None] for lp, t in zip(result.output_logprobs, result.output_ids, strict=True)
        ],
    }
    if result.prompt_logprobs is not None and logprob_start >= 0:
        meta["input_token_logprobs"] = [
            [None if math.isnan(lp) else lp, t, None]
            for lp, t in list(zip(result.prompt_logprobs, result.prompt_ids, strict=True))[
                logprob_start:
            ]
        ]
    if result.top_logprobs is not None:
        meta["output_top_logprobs"] = [
            [[lp, t, None] for t, lp in row] for row in result.top_logprobs
        ]
    if result.routed_experts is not None:
        meta["routed_experts"] = encode_array(result.routed_experts, "<i4")
    if result.sampling_mask is not None:
        ids, offsets = result.sampling_mask.tensors()
        meta["sampling_mask"] = {
            "ids": encode_array(ids, "<i4"),
            "offsets": encode_array(offsets, "<i8"),
        }
    return {"text": text, "output_ids": list(result.output_ids), "meta_info": meta}


def _finish_reason(result: GenerateResult, text: str, stop_ids: frozenset[int]) -> dict:
    if result.finish_reason == "length":
        return {"type": "length", "length": len(result.output_ids)}
    if result.finish_reason == "abort":
        return {"type": "abort", "message": "aborted"}
    last = result.output_ids[-1]
    if last in stop_ids:
        return {"type": "stop", "matched": last}
    return {"type": "stop", "matched": text}


def generate_result(
    body: Mapping[str, Any],
    prompt: list[int],
    params: SamplingParams,
    routing_shape: tuple[int, int] | None,
) -> GenerateResult:
    """A :class:`GenerateResult` from one ``/generate`` response object (client side)."""
    meta = body["meta_info"]
    output = [int(t) for t in body["output_ids"]]
    logprobs = [float(lp) for lp, *_ in meta.get("output_token_logprobs") or []]
    if len(logprobs) != len(output):
        raise ValueError(f"{len(logprobs)} output log-probs for {len(output)} output tokens")
    prompt_lp = None
    if params.prompt_logprobs:
        prompt_lp = [
            math.nan if lp is None else float(lp) for lp, *_ in meta["input_token_logprobs"]
        ]
    top = None
    if params.top_logprobs:
        top = [
            [(int(t), float(lp)) for lp, t, *_ in row or []] for row in meta["output_top_logprobs"]
        ]
    routed = None
    if params.return_routed_experts:
        if routing_shape is None:
            raise ValueError("routed experts asked for, but the routing shape is unknown")
        flat = decode_array(meta["routed_experts"], "<i4", "meta_info.routed_experts")
        routed = torch.from_numpy(flat.copy()).view(-1, *routing_shape)
    mask = None
    if "sampling_mask" in meta:
        csr = meta["sampling_mask"]
        ids = decode_array(csr["ids"], "<i4", "meta_info.sampling_mask.ids")
        offsets = decode_array(csr["offsets"], "<i8", "meta_info.sampling_mask.offsets")
        mask = SamplingMask(torch.from_numpy(ids.copy()), torch.from_numpy(offsets.copy()))
    reason = meta["finish_reason"]["type"]
    if reason not in ("stop", "length", "abort"):
        raise ValueError(f"finish_reason: unknown type {reason!r}")
    version = meta.get("weight_version", "0")
    return GenerateResult(
        request_id=meta.get("id", ""),
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=logprobs,
        finish_reason=reason,
        sampling_mask=mask,
        weight_version=parse_version(version) or 0,
        prompt_logprobs=prompt_lp,
        top_logprobs=top,
        routed_experts=routed,
        routed_experts_start=params.routed_experts_start if params.return_routed_experts else 0,
    )
