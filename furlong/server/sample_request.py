"""Tinker's ``SampleRequest`` in furlong's terms: the request checked whole against the model
and the server's caps (prompt + ``max_tokens`` within the context, ``num_samples``,
``max_tokens`` and top-k caps, stop rules, seeds, ``target_prompt_logprobs``) into one
:class:`SamplingParams` per sample, and the engine's results back into the SDK's
``SampleResponse``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from tinker import types as tt

from furlong.errors import InputError
from furlong.rollout.base import GenerateResult
from furlong.rollout.sampling import MAX_SEED, SamplingParams, csr_tensor, fit_max_tokens
from furlong.server import proto
from furlong.server.futures import Failure


@dataclass(frozen=True)
class SampleCaps:
    max_samples: int = 1024  # num_samples of one request
    max_sample_tokens: int = 4096  # max_tokens of one request (also <= the context)
    max_top_logprobs: int = 64  # topk_*_logprobs, and K of target_prompt_logprobs


class ModelShape(Protocol):
    """What a request is checked against: the sampled model's vocabulary and context."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def context_length(self) -> int | None: ...


@dataclass(frozen=True)
class CheckedRequest:
    prompt: list[int]
    params: list[SamplingParams]  # one per sample
    scored_from: int  # the first prompt position whose log-probs are returned


def check_request(req: tt.SampleRequest, engine: ModelShape, caps: SampleCaps) -> CheckedRequest:
    """The whole request checked (an ``InputError`` names the field) before anything is queued."""
    for name in ("prompt_alt_tokens_k", "record_stability_info"):
        if getattr(req, name, None):
            raise InputError(f"{name}: not supported by furlong")
    if not 1 <= req.num_samples <= caps.max_samples:
        raise InputError(f"num_samples: must be in [1, {caps.max_samples}], got {req.num_samples}")
    top = caps.max_top_logprobs
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
        k = getattr(req, name)
        if not 0 <= k <= top:  # each is k entries per token of every sequence returned
            raise InputError(f"{name}: must be in [0, {top}], got {k}")
    if (top_k := req.sampling_params.top_k) < -1:
        raise InputError(f"sampling_params.top_k: -1 or 0 (no limit) or >= 1, got {top_k}")
    prompt = _tokens(req.prompt, "prompt")
    scored_from = _prompt_scored_from(req, len(prompt))
    params = sampling_params(req, len(prompt), engine, caps)
    return CheckedRequest(prompt, params, scored_from)


def sampling_params(
    req: tt.SampleRequest, prompt_len: int, engine: ModelShape, caps: SampleCaps
) -> list[SamplingParams]:
    """One ``SamplingParams`` per sample (sample i draws with ``seed + i``; prompt log-probs
    and target prompt log-probs are computed once, for the first), every field checked against
    the engine and the caps."""
    sp = req.sampling_params
    targets = _target_ids(req.target_prompt_logprobs, prompt_len, engine, caps)
    max_tokens = fit_max_tokens(
        sp.max_tokens,
        prompt_len,
        engine.context_length,
        caps.max_sample_tokens,
        "sampling_params.max_tokens",
    )
    if sp.seed is not None and not 0 <= sp.seed <= MAX_SEED - (req.num_samples - 1):
        raise InputError(  # sample i draws with seed + i
            f"sampling_params.seed: must be in [0, 2**64 - num_samples], got {sp.seed}"
        )
    stop_ids: tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] = ()
    if sp.stop is not None:
        stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop)
        ids = [s for s in stops if isinstance(s, int)]
        texts = [s for s in stops if isinstance(s, str)]
        if len(ids) == len(stops):
            stop_ids = tuple(ids)  # [] -> never stop, not even at EOS
            for j, t in enumerate(stop_ids):  # an id outside could never end a sequence
                if not 0 <= t < engine.vocab_size:
                    raise InputError(
                        f"sampling_params.stop[{j}]: token id {t} outside [0, {engine.vocab_size})"
                    )
        elif len(texts) == len(stops):
            stop_strings = tuple(texts)
        else:
            raise InputError("sampling_params.stop: mixes strings and token ids")
    return [
        SamplingParams(  # checks and names the remaining fields
            max_tokens=max_tokens,
            temperature=sp.temperature,
            top_k=sp.top_k if sp.top_k > 0 else 0,
            top_p=sp.top_p,
            stop_token_ids=stop_ids,
            stop=stop_strings,
            top_logprobs=req.topk_sample_logprobs,
            seed=None if sp.seed is None else sp.seed + i,
            prompt_logprobs=bool(req.prompt_logprobs) and i == 0,
            prompt_top_logprobs=req.topk_prompt_logprobs if i == 0 else 0,
            prompt_target_ids=targets if i == 0 else None,
        )
        for i in range(req.num_samples)
    ]


def _tokens(model_input: tt.ModelInput, field_name: str) -> list[int]:
    tokens: list[int] = []
    for j, chunk in enumerate(model_input.chunks):
        if not isinstance(chunk, tt.EncodedTextChunk):  # the one chunk whose type is encoded_text
            kind = getattr(chunk, "type", None)
            raise InputError(
                f"{field_name}.chunks[{j}]: only encoded_text chunks are supported, got {kind}"
            )
        tokens.extend(int(t) for t in chunk.tokens)
    if not tokens:
        raise InputError(f"{field_name}: empty")
    return tokens


_TARGET = "target_prompt_logprobs"


def _target_ids(
    td: Any, prompt_len: int, engine: ModelShape, caps: SampleCaps
) -> torch.Tensor | None:
    """``target_prompt_logprobs`` (the SDK's JSON ``TensorData``) as the engine's
    ``prompt_target_ids``: int64 ``[len(prompt) - 1, K]``, kept sparse CSR when it came so, so
    the result comes back in the request's layout. K is bounded like a top-k width: each
    position returns K log-probs. ``prompt_logprobs_last_n`` does not apply (the SDK says so)."""
    if td is None:
        return None
    if td.dtype != "int64":
        raise InputError(f"{_TARGET}: must be an int64 tensor of token ids, got {td.dtype}")
    shape = None if td.shape is None else [int(d) for d in td.shape]
    rows = prompt_len - 1
    if shape is None or len(shape) != 2:
        raise InputError(f"{_TARGET}: must be 2-D, [len(prompt) - 1, K], got shape {shape}")
    if shape[0] != rows:
        raise InputError(
            f"{_TARGET}: shape {shape} has {shape[0]} rows; a prompt of {prompt_len} tokens "
            f"needs len(prompt) - 1 = {rows}"
        )
    if not 1 <= shape[1] <= caps.max_top_logprobs:
        raise InputError(
            f"{_TARGET}: K = {shape[1]} ids per position (shape {shape}); must be in "
            f"[1, {caps.max_top_logprobs}]"
        )
    k = shape[1]
    values = _int_values(td.data)
    sparse = td.sparse_crow_indices is not None or td.sparse_col_indices is not None
    if sparse:
        crow, col, row_of = _csr_indices(td, shape, values.size)
    elif values.size != rows * k:
        raise InputError(f"{_TARGET}.data: {values.size} values for shape {shape}")
    else:
        crow = col = row_of = np.zeros(0, dtype=np.int64)  # dense: no CSR indices
    bad = np.flatnonzero((values < -1) | (values >= engine.vocab_size))
    if bad.size:
        n = int(bad[0])  # the n-th value: a listed cell when sparse, row-major when dense
        i, j = (int(row_of[n]), int(col[n])) if sparse else divmod(n, k)
        raise InputError(
            f"{_TARGET}[{i}, {j}]: token id {int(values[bad[0]])} outside "
            f"[0, {engine.vocab_size}) (-1 asks for nothing)"
        )
    if not (values >= 0).any():  # the SDK: "at least one id"
        raise InputError(f"{_TARGET}: names no token id (every cell is -1 or unlisted)")
    ids = torch.from_numpy(values)
    if not sparse:
        return ids.reshape(rows, k)
    return csr_tensor(torch.from_numpy(crow), torch.from_numpy(col), ids, (rows, k))


def _int_values(data: list) -> np.ndarray:
    """The JSON ``data`` list as int64 (pydantic reads it as ints, or as floats when any value
    is one; ints beyond int64 make numpy's array unsigned or of objects)."""
    values = np.asarray(data)
    if values.size == 0:
        return np.zeros(0, dtype=np.int64)
    if values.ndim == 1 and values.dtype.kind == "i":
        return values.astype(np.int64, copy=False)
    for n, v in enumerate(data):  # the slow path only finds the value to name
        if not isinstance(v, int) or isinstance(v, bool):
            raise InputError(f"{_TARGET}.data[{n}]: expected an integer token id, got {v!r}")
        if not -(2**63) <= v < 2**63:
            raise InputError(f"{_TARGET}.data[{n}]: token id {v} is beyond int64")
    raise InputError(f"{_TARGET}.data: expected a flat list of integer token ids")


def _csr_indices(td: Any, shape: list[int], nnz: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A sparse request's CSR indices, checked as the SDK's ``to_torch`` would (torch's
    invariants: offsets from 0 to nnz, columns in range and strictly increasing per row),
    and the row of every listed value."""
    rows, k = shape
    if td.sparse_crow_indices is None or td.sparse_col_indices is None:
        raise InputError(f"{_TARGET}: sparse_crow_indices and sparse_col_indices go together")
    try:
        crow = np.asarray(td.sparse_crow_indices, dtype=np.int64).reshape(-1)
        col = np.asarray(td.sparse_col_indices, dtype=np.int64).reshape(-1)
    except (OverflowError, TypeError, ValueError) as e:
        raise InputError(f"{_TARGET}: sparse indices must be int64 ({e})") from e
    if crow.size != rows + 1 or crow[0] != 0 or crow[-1] != nnz or (np.diff(crow) < 0).any():
        raise InputError(
            f"{_TARGET}.sparse_crow_indices: expected {rows + 1} non-decreasing offsets from 0 "
            f"to {nnz} (the number of values)"
        )
    if col.size != nnz or (col < 0).any() or (col >= k).any():
        raise InputError(f"{_TARGET}.sparse_col_indices: expected {nnz} columns in [0, {k})")
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    if ((row_of[1:] == row_of[:-1]) & (col[1:] <= col[:-1])).any():
        raise InputError(
            f"{_TARGET}.sparse_col_indices: must be strictly increasing within each row"
        )
    return crow, col, row_of


def _prompt_scored_from(req: tt.SampleRequest, prompt_len: int) -> int:
    """The first prompt position whose log-probs are returned (``prompt_logprobs_last_n``)."""
    last_n = req.prompt_logprobs_last_n
    if last_n is None:
        return 1
    if not req.prompt_logprobs:
        raise InputError("prompt_logprobs_last_n: requires prompt_logprobs")
    if not 1 <= last_n <= prompt_len - 1:
        raise InputError(
            f"prompt_logprobs_last_n: must be in [1, {prompt_len - 1}] for this prompt, "
            f"got {last_n}"
        )
    return prompt_len - last_n


def sample_result(futures: list, scored_from: int) -> Any:
    """The SDK's ``SampleResponse`` (protobuf) of finished sequences, or why they failed."""
    try:
        results: list[GenerateResult] = [f.result() for f in futures]
    except InputError as e:
        return Failure(str(e), "user")
    except Exception as e:  # noqa: BLE001 - reported to the client, not raised in a callback
        return Failure(f"{type(e).__name__}: {e}", "server")
    sequences = [
        proto.SampledSeq(
            tokens=r.output_ids,
            logprobs=r.output_logprobs,
            stop_reason="length" if r.finish_reason == "length" else "stop",
            topk=r.top_logprobs,
        )
        for r in results
    ]
    first = results[0]
    pad: list[None] = [None] * scored_from
    prompt_lp: list[float | None] | None = None
    prompt_top: list[list[tuple[int, float]] | None] | None = None
    if first.prompt_logprobs is not None:
        prompt_lp = [*pad, *first.prompt_logprobs[scored_from:]]
    if first.prompt_top_logprobs is not None:
        prompt_top = [*pad, *first.prompt_top_logprobs[scored_from:]]
    return proto.encode_sample_response(
        sequences, prompt_lp, prompt_top, first.prompt_target_logprobs
    )
