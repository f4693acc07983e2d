"""Protobuf codecs of the Tinker service: ``ForwardBackwardRequest`` in, ``ForwardBackwardOutput``
and ``SampleResponse`` out.

The schema is the SDK's own (``tinker.proto.tinker_public_pb2``), never a re-declared copy, so
server and client cannot drift apart. Every byte array on the wire is little-endian; malformed
client input raises ``InputError`` naming the field (``data[i].loss_fn_inputs['key']: ...``),
while malformed server output (a metric key without exactly one ``:``) raises ``ValueError``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from furlong.errors import InputError
from furlong.train.validation import check_request
from furlong.types import Datum, ForwardResult

PROTOBUF = "application/x-protobuf"

# Explicit little-endian dtypes: the wire is LE whatever the host's byte order.
_WIRE_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_BFLOAT16: np.dtype("<u2"),  # upper half of a float32
}
_I32 = np.dtype("<i4")
_I64 = np.dtype("<i8")
_F32 = np.dtype("<f4")

# zstd expands at most ~32 KiB per input byte, so feeding 1 KiB at a time overshoots
# max_bytes by at most ~32 MiB before the bomb is caught.
_ZSTD_STEP = 1 << 10
_TOPK_PAD = (0, -99999.0)  # the SDK's padding cell for rows with fewer than k entries
_Wire = tuple["pb.DType.ValueType", np.ndarray]  # a tensor as sent: its wire dtype and data


@dataclass(frozen=True)
class Limits:
    """What one ``forward_backward`` body may make the server allocate, checked before it does:
    the inflated body, the datum count and length, and tensor elements once dense (a few KB of
    sparse CSR can declare a shape of gigabytes)."""

    max_bytes: int | None = None
    max_datums: int | None = None
    max_tokens_per_datum: int | None = None
    max_tensor_elements: int = 1 << 22
    max_request_elements: int = 1 << 26
    zstd: bool = True  # accept zstd bodies (the server asks for them: --compress-fwdbwd)


@dataclass(frozen=True)
class FwdBwdRequest:
    model_id: str
    seq_id: int
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None
    forward_only: bool


@dataclass(frozen=True)
class SampledSeq:
    """One sampled sequence; ``tokens`` include the terminating token(s)."""

    tokens: list[int]
    logprobs: list[float]  # one per token; the client maps an empty array to None
    stop_reason: Literal["stop", "length"]
    topk: Sequence[Sequence[tuple[int, float]] | None] | None = (
        None  # per token: (id, logprob) pairs
    )


# ---------------------------------------------------------------- request


def parse_forward_backward(
    body: bytes, content_encoding: str | None, limits: Limits | None = None
) -> FwdBwdRequest:
    """Decode a (possibly zstd-compressed) ``ForwardBackwardRequest`` body: the wire format
    only (the service's :func:`convert_forward_backward` also checks it against its loss)."""
    return _request(decode_forward_backward(body, content_encoding, limits), limits)


def decode_forward_backward(
    body: bytes, content_encoding: str | None, limits: Limits | None = None
) -> pb.ForwardBackwardRequest:
    """Inflate (capped at ``limits.max_bytes`` while streaming) and decode the protobuf; the
    tensors stay as wire bytes."""
    limits = limits or Limits()
    max_bytes = limits.max_bytes
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "zstd" and not limits.zstd:
        raise InputError(
            "Content-Encoding: zstd bodies are off on this server (start it with --compress-fwdbwd)"
        )
    if encoding == "zstd":
        body = _unzstd(body, max_bytes)
    elif encoding != "identity":
        raise InputError(f"Content-Encoding: unsupported {content_encoding!r} (use zstd)")
    elif max_bytes is not None and len(body) > max_bytes:
        raise InputError(f"body: {len(body)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        return pb.ForwardBackwardRequest.FromString(body)
    except DecodeError:
        raise InputError("body: not a ForwardBackwardRequest protobuf") from None


def convert_forward_backward(
    msg: pb.ForwardBackwardRequest, limits: Limits | None = None
) -> FwdBwdRequest:
    """Every datum as furlong types, after checking what densifying them would allocate, then
    the request against its loss (``loss_fn``, ``loss_fn_config``, every input's shape and
    range: ``check_request``), so what the loss would refuse is refused at submission."""
    request = _request(msg, limits)
    check_request(request.data, request.loss_fn, request.loss_fn_config)
    return request


def _request(msg: pb.ForwardBackwardRequest, limits: Limits | None) -> FwdBwdRequest:
    limits = limits or Limits()
    if not msg.data:
        raise InputError("data: at least one datum is required")
    if msg.seq_id < 1:
        raise InputError(f"seq_id: expected an integer >= 1, got {msg.seq_id}")
    _check_sizes(msg, limits)
    data = [_datum(d, f"data[{i}]") for i, d in enumerate(msg.data)]
    if msg.loss_fn == "cross_entropy":  # the protocol's default weights are ones
        data = [_with_unit_weights(d) for d in data]
    return FwdBwdRequest(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        data=data,
        loss_fn=msg.loss_fn,
        loss_fn_config=_loss_fn_config(msg),
        forward_only=msg.forward_only,
    )


def _check_sizes(msg: pb.ForwardBackwardRequest, limits: Limits) -> None:
    if limits.max_datums is not None and len(msg.data) > limits.max_datums:
        raise InputError(f"data: {len(msg.data)} datums; the limit is {limits.max_datums}")
    total = 0
    for i, d in enumerate(msg.data):
        tokens = sum(_chunk_tokens(c) for c in d.model_input)
        cap = limits.max_tokens_per_datum
        if cap is not None and tokens > cap:
            raise InputError(f"data[{i}].model_input: {tokens} tokens; the limit is {cap}")
        total += tokens
        for key, t in d.loss_fn_inputs.items():
            n = _dense_elements(t)
            where = f"data[{i}].loss_fn_inputs[{key!r}]"
            if n > limits.max_tensor_elements:
                raise InputError(
                    f"{where}: {n} elements once dense; the limit is {limits.max_tensor_elements}"
                )
            total += n
            if total > limits.max_request_elements:
                raise InputError(
                    f"{where}: the request's tensors pass {limits.max_request_elements} elements "
                    "once dense; send fewer or smaller datums per request"
                )


def _chunk_tokens(chunk: pb.Chunk) -> int:
    return len(chunk.encoded_text.tokens) // 4 if chunk.WhichOneof("chunk") == "encoded_text" else 0


def _dense_elements(t: pb.Tensor) -> int:
    """Elements the tensor has once dense, from its declared shape or its byte count."""
    shape = [max(int(s), 0) for s in t.shape]
    if t.WhichOneof("encoding") == "sparse_csr" or shape:
        return math.prod(shape)
    dtype = _WIRE_DTYPES.get(t.dtype)
    return len(t.dense) // dtype.itemsize if dtype is not None else 0


def _with_unit_weights(d: Datum) -> Datum:
    if "weights" in d.loss_fn_inputs or "target_tokens" not in d.loss_fn_inputs:
        return d
    ones = torch.ones(d.loss_fn_inputs["target_tokens"].shape, dtype=torch.float32)
    return Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, "weights": ones})


def _unzstd(body: bytes, max_bytes: int | None) -> bytes:
    """Decompress every frame of ``body``, failing as soon as the output passes ``max_bytes``."""
    out = bytearray()
    view = memoryview(body)
    pos = 0
    try:
        while pos < len(view):  # one decompressobj per frame (RFC 8878 allows several)
            frame = zstandard.ZstdDecompressor().decompressobj()
            while not frame.eof:
                if pos >= len(view):
                    raise InputError("body: truncated zstd frame")
                end = min(pos + _ZSTD_STEP, len(view))
                out += frame.decompress(view[pos:end])
                pos = end
                if max_bytes is not None and len(out) > max_bytes:
                    raise InputError(
                        f"body: decompressed size exceeds the limit of {max_bytes} bytes"
                    )
            pos -= len(frame.unused_data)
    except zstandard.ZstdError as exc:
        raise InputError(f"body: invalid zstd data ({exc})") from None
    return bytes(out)


def _loss_fn_config(msg: pb.ForwardBackwardRequest) -> dict[str, float | str] | None:
    # The client writes numbers into both maps and strings only into v2: prefer v2.
    if msg.loss_fn_config_v2:
        config: dict[str, float | str] = {}
        for key, value in msg.loss_fn_config_v2.items():
            kind = value.WhichOneof("value")
            if kind is None:
                raise InputError(f"loss_fn_config[{key!r}]: no number or text value")
            config[key] = value.number if kind == "number" else value.text
        return config
    return dict(msg.loss_fn_config) or None


def _datum(msg: pb.Datum, where: str) -> Datum:
    tokens = []
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InputError(
                f"{where}.model_input.chunks[{j}]: only encoded_text chunks are supported, "
                f"got {kind or 'an empty chunk'}"
            )
        tokens.append(_array(chunk.encoded_text.tokens, _I32, f"{where}.model_input.chunks[{j}]"))
    ids = np.concatenate(tokens) if tokens else np.zeros(0, _I32)
    inputs = {
        key: _tensor(t, f"{where}.loss_fn_inputs[{key!r}]") for key, t in msg.loss_fn_inputs.items()
    }
    try:
        return Datum(model_input=torch.from_numpy(ids.astype(np.int64)), loss_fn_inputs=inputs)
    except InputError as exc:  # Datum names the field but not the datum
        raise InputError(f"{where}.{exc}") from None


def _array(buf: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    """LE bytes → a writable native-order array (bfloat16 widened to float32)."""
    if len(buf) % dtype.itemsize:
        raise InputError(f"{where}: {len(buf)} bytes is not a multiple of {dtype.itemsize}")
    arr = np.frombuffer(buf, dtype)
    if dtype == _WIRE_DTYPES[pb.DTYPE_BFLOAT16]:
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(dtype.newbyteorder("="))


def _tensor(msg: pb.Tensor, where: str) -> torch.Tensor:
    dtype = _WIRE_DTYPES.get(msg.dtype)
    if dtype is None:
        raise InputError(f"{where}: unsupported dtype {msg.dtype}")
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise InputError(f"{where}: negative dimension in shape {shape}")
    encoding = msg.WhichOneof("encoding")
    if encoding == "sparse_csr":
        return torch.from_numpy(_densify(msg.sparse_csr, dtype, shape, where))
    values = _array(msg.dense, dtype, where)  # an unset oneof reads as an empty dense tensor
    if not shape:  # the SDK omits the shape of a TensorData built without one: 1-D
        shape = [values.size]
    if values.size != math.prod(shape):
        raise InputError(
            f"{where}: {len(msg.dense)} bytes hold {values.size} elements, "
            f"shape {shape} needs {math.prod(shape)}"
        )
    return torch.from_numpy(values.reshape(shape))


def _densify(csr: pb.SparseCsr, dtype: np.dtype, shape: list[int], where: str) -> np.ndarray:
    """CSR → dense; unlisted entries are 0 (the SDK only sparsifies with pad 0)."""
    if len(shape) != 2:
        raise InputError(f"{where}: sparse_csr needs a 2-D shape, got {shape}")
    rows, cols = shape  # the dense size was checked against the limits before
    values = _array(csr.values, dtype, f"{where}.values")
    crow = _array(csr.crow_indices, _I64, f"{where}.crow_indices")
    col = _array(csr.col_indices, _I64, f"{where}.col_indices")
    nnz = values.size
    if crow.size != rows + 1 or crow[0] != 0 or crow[-1] != nnz or np.any(np.diff(crow) < 0):
        raise InputError(
            f"{where}.crow_indices: expected {rows + 1} non-decreasing offsets from 0 to "
            f"{nnz} (the number of values)"
        )
    if col.size != nnz or np.any(col < 0) or np.any(col >= cols):
        raise InputError(f"{where}.col_indices: expected {nnz} column indices in [0, {cols})")
    starts = np.zeros(nnz, dtype=bool)
    starts[crow[:-1][crow[:-1] < nnz]] = True
    if np.any(~starts[1:] & (col[1:] <= col[:-1])):  # a repeat would silently overwrite
        raise InputError(f"{where}.col_indices: must be strictly increasing within each row")
    dense = np.zeros((rows, cols), dtype=values.dtype)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return dense


# ---------------------------------------------------------------- responses


def encode_forward_backward_output(result: ForwardResult) -> bytes:
    """``ForwardResult`` → ``ForwardBackwardOutput`` bytes (one output per datum, in order).

    Each field holds a tensor every datum has. The client rebuilds a datum's array as
    ``[elements / prod(trailing), *trailing]``, so a 0-d value (a per-datum ``loss``) arrives as
    shape ``(1,)``; datums whose dtypes or trailing shapes differ go to separate records.
    """
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in result.metrics.items():
        if key.count(":") != 1:  # the client splits on ':' and raises otherwise
            raise ValueError(f"metric key {key!r} must be 'name:reduction' with exactly one ':'")
        msg.metrics[key] = float(value)
    outputs = [
        {k: _wire_array(v) for k, v in out.items() if isinstance(v, torch.Tensor | np.ndarray)}
        for out in result.outputs
    ]
    names = sorted(set.intersection(*(set(o) for o in outputs))) if outputs else []
    run: list[dict[str, _Wire]] = []
    for out in outputs:
        if run and _signature(out, names) != _signature(run[0], names):
            _add_record(msg, run, names)
            run = []
        run.append(out)
    if run:
        _add_record(msg, run, names)
    return msg.SerializeToString()


def _wire_array(value: torch.Tensor | np.ndarray) -> _Wire:
    """A tensor → (wire dtype, LE array): float32 unless bf16, int32 kept, other ints int64."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            return pb.DTYPE_BFLOAT16, value.view(torch.int16).numpy().view(np.uint16).astype("<u2")
        value = value.numpy()
    if value.dtype.kind == "f":
        return pb.DTYPE_FLOAT32, value.astype(_F32)
    if value.dtype == np.int32:
        return pb.DTYPE_INT32, value.astype(_I32)
    return pb.DTYPE_INT64, value.astype(_I64)


def _signature(out: dict[str, _Wire], names: list[str]) -> list[tuple]:
    return [(out[n][0], out[n][1].shape[1:]) for n in names]


def _add_record(
    msg: pb.ForwardBackwardOutput, run: list[dict[str, _Wire]], names: list[str]
) -> None:
    record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(run))
    for name in names:
        dtype, first = run[0][name]
        parts = [np.ascontiguousarray(out[name][1]).tobytes() for out in run]
        record.fields[name].CopyFrom(
            pb.BatchedTensor(
                data=b"".join(parts),
                offsets=np.cumsum([0] + [len(p) for p in parts], dtype=_I64).tobytes(),
                dtype=dtype,
                trailing_shape=first.shape[1:],
            )
        )


def encode_sample_response(
    sequences: Sequence[SampledSeq],
    prompt_logprobs: Sequence[float | None] | None = None,
    topk_prompt: Sequence[Sequence[tuple[int, float]] | None] | None = None,
    target_prompt: torch.Tensor | None = None,
) -> bytes:
    """Sampled sequences (+ optional prompt log-probs, ``None``/NaN where undefined,
    per-position top-k prompt alternatives, ``None``/empty where undefined, and the log-probs
    of ``target_prompt_logprobs``' ids: a 2-D float tensor, dense or sparse CSR, NaN where the
    request's id was -1) → bytes."""
    msg = pb.SampleResponse()
    for i, seq in enumerate(sequences):
        if len(seq.logprobs) != len(seq.tokens):
            raise ValueError(
                f"sequences[{i}]: {len(seq.logprobs)} logprobs for {len(seq.tokens)} tokens"
            )
        out = msg.sequences.add(
            stop_reason=_STOP_REASONS[seq.stop_reason],
            tokens=np.asarray(seq.tokens, dtype=_I32).tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype=_F32).tobytes(),
        )
        if seq.topk is not None and (topk := _topk(seq.topk)) is not None:
            out.topk_sampled_logprobs.CopyFrom(topk)
    if prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype=_F32).tobytes()
    if topk_prompt is not None and (topk := _topk(topk_prompt)) is not None:
        msg.topk_prompt_logprobs.CopyFrom(topk)
    if target_prompt is not None:
        msg.target_prompt_logprobs.CopyFrom(_target_tensor(target_prompt))
    return msg.SerializeToString()


def _target_tensor(values: torch.Tensor) -> pb.Tensor:
    """The response's ``target_prompt_logprobs``: float32 in the request's shape and layout
    (the SDK decodes a sparse one with ``to_torch()``, unlisted cells 0), and 0.0 where the
    request had -1, the SDK's documented value for a cell that asked nothing."""
    shape = list(values.shape)
    if values.layout == torch.sparse_csr:
        listed = _nan_as_zero(values.values())
        return pb.Tensor(
            sparse_csr=pb.SparseCsr(
                values=listed.astype(_F32).tobytes(),
                crow_indices=values.crow_indices().cpu().numpy().astype(_I64).tobytes(),
                col_indices=values.col_indices().cpu().numpy().astype(_I64).tobytes(),
            ),
            dtype=pb.DTYPE_FLOAT32,
            shape=shape,
        )
    dense = _nan_as_zero(values)
    return pb.Tensor(dense=dense.astype(_F32).tobytes(), dtype=pb.DTYPE_FLOAT32, shape=shape)


def _nan_as_zero(values: torch.Tensor) -> np.ndarray:
    """NaN (nothing asked) → 0.0; a -inf log-prob stays -inf (``nan_to_num`` would clip it)."""
    values = values.detach().float().cpu()
    return torch.where(torch.isnan(values), 0.0, values).numpy()


_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


def _topk(rows: Sequence[Sequence[tuple[int, float]] | None]) -> pb.TopkLogprobs | None:
    """Rows of (token, logprob) → a ``length × k`` block padded with ``_TOPK_PAD`` (an all-pad
    row decodes as None). The client decodes ``length == 0`` or ``k == 0`` as None: left unset."""
    filled = [row or () for row in rows]
    k = max((len(r) for r in filled), default=0)
    if not filled or k == 0:
        return None
    ids = np.full((len(filled), k), _TOPK_PAD[0], dtype=_I32)
    lps = np.full((len(filled), k), _TOPK_PAD[1], dtype=_F32)
    for t, row in enumerate(filled):
        for j, (token, logprob) in enumerate(row):
            ids[t, j], lps[t, j] = token, logprob
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(filled))


__all__ = [
    "PROTOBUF",
    "FwdBwdRequest",
    "Limits",
    "SampledSeq",
    "encode_forward_backward_output",
    "convert_forward_backward",
    "decode_forward_backward",
    "encode_sample_response",
    "parse_forward_backward",
]
