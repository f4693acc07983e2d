"""The protobuf codecs against the SDK's own client-side codecs (``tinker.proto``) as oracles."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tinker.types as tt
import torch
import zstandard
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from furlong.errors import InputError
from furlong.server.proto import (
    Limits,
    SampledSeq,
    encode_forward_backward_output,
    encode_sample_response,
    parse_forward_backward,
)
from furlong.types import ForwardResult

# ---------------------------------------------------------------- helpers


def sdk_message(data, loss_fn="cross_entropy", config=None, seq_id=1, forward_only=False):
    """The proto exactly as the SDK's training resource builds it."""
    request = tt.ForwardBackwardRequest(
        forward_backward_input=tt.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=config
        ),
        model_id="sess:train:0",
        seq_id=seq_id,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg


def sdk_body(data, compress=False, **kwargs) -> bytes:
    body = sdk_message(data, **kwargs).SerializeToString()
    return zstandard.ZstdCompressor().compress(body) if compress else body


def parse(body: bytes, compress: bool = False, **kwargs):
    return parse_forward_backward(body, "zstd" if compress else None, Limits(**kwargs))


def ce_datum(tokens: list[int]) -> tt.Datum:
    n = len(tokens)
    return tt.Datum(
        model_input=tt.ModelInput.from_ints(tokens),
        loss_fn_inputs={
            "target_tokens": [t + 1 for t in tokens],
            "weights": np.linspace(-1.0, 1.0, n, dtype=np.float32),
        },
    )


def assert_same_inputs(ours, theirs: tt.Datum) -> None:
    assert ours.model_input.dtype == torch.int64
    assert ours.model_input.tolist() == theirs.model_input.to_ints()
    assert set(ours.loss_fn_inputs) == set(theirs.loss_fn_inputs)
    for key, td in theirs.loss_fn_inputs.items():
        expected = td.to_torch()
        got = ours.loss_fn_inputs[key]
        assert got.shape == expected.shape, key
        assert got.dtype == (torch.int64 if key == "target_tokens" else torch.float32), key
        assert torch.equal(got, expected.to(got.dtype)), key


# ---------------------------------------------------------------- requests


@pytest.mark.parametrize("compress", [False, True])
def test_parse_matches_sdk_request(compress: bool) -> None:
    data = [
        ce_datum([5, 151_643, 7]),  # a Qwen-sized id: int32 on the wire
        tt.Datum(  # several chunks are one token sequence
            model_input=tt.ModelInput(
                chunks=[tt.EncodedTextChunk(tokens=[1, 2]), tt.EncodedTextChunk(tokens=[3, 4])]
            ),
            loss_fn_inputs={
                "target_tokens": torch.tensor([2, 3, 4, 9]),
                "logprobs": torch.tensor([-0.5, -1.5, -2.0, -0.25]),
                "advantages": [1.0, 0.0, -2.5, 3.0],
            },
        ),
    ]
    req = parse(
        sdk_body(data, compress, loss_fn="importance_sampling", seq_id=7, forward_only=True),
        compress,
    )
    assert (req.model_id, req.seq_id, req.loss_fn, req.forward_only) == (
        "sess:train:0",
        7,
        "importance_sampling",
        True,
    )
    assert req.loss_fn_config is None
    assert len(req.data) == 2
    for ours, theirs in zip(req.data, data, strict=True):
        assert_same_inputs(ours, theirs)


@pytest.mark.parametrize("compress", [False, True])
def test_top_k_targets_arrive_sparse_and_densify(compress: bool) -> None:
    n, k = 6, 4
    targets = torch.zeros(n, k, dtype=torch.int64)
    weights = torch.zeros(n, k)
    targets[1, :2] = torch.tensor([11, 12])
    weights[1, :2] = torch.tensor([0.75, 0.25])
    targets[4, 3] = 40
    weights[4, 3] = -1.0
    datum = tt.Datum(
        model_input=tt.ModelInput.from_ints(list(range(n))),
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )
    msg = sdk_message([datum])
    for key in ("target_tokens", "weights"):  # the SDK really chose CSR
        assert msg.data[0].loss_fn_inputs[key].WhichOneof("encoding") == "sparse_csr"
    req = parse(sdk_body([datum], compress), compress)
    assert_same_inputs(req.data[0], datum)
    assert torch.equal(req.data[0].loss_fn_inputs["target_tokens"], targets)
    assert torch.equal(req.data[0].loss_fn_inputs["weights"], weights)


def test_dense_top_k_and_every_wire_dtype() -> None:
    datum = tt.Datum(
        model_input=tt.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"target_tokens": torch.tensor([[3, 4], [5, 6]])},  # dense: no saving
    )
    msg = sdk_message([datum])
    assert msg.data[0].loss_fn_inputs["target_tokens"].WhichOneof("encoding") == "dense"
    # int32 targets and bfloat16 weights are legal on the wire even if the SDK never sends them
    bf16 = torch.tensor([0.5, -2.0], dtype=torch.bfloat16).view(torch.int16).numpy()
    msg.data[0].loss_fn_inputs["weights"].CopyFrom(
        pb.Tensor(dense=bf16.tobytes(), dtype=pb.DTYPE_BFLOAT16, shape=[2])
    )
    msg.data[0].loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dense=np.array([7, 8], "<i4").tobytes(), dtype=pb.DTYPE_INT32, shape=[2])
    )
    req = parse(msg.SerializeToString())
    assert req.data[0].loss_fn_inputs["target_tokens"].tolist() == [7, 8]
    assert req.data[0].loss_fn_inputs["weights"].tolist() == [0.5, -2.0]
    # and a dense 2-D tensor through the SDK keeps its shape
    req = parse(sdk_body([datum]))
    assert req.data[0].loss_fn_inputs["target_tokens"].tolist() == [[3, 4], [5, 6]]


def test_shapeless_dense_tensor_reads_as_1d() -> None:
    datum = tt.Datum(
        model_input=tt.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": tt.TensorData(data=[2, 3, 4], dtype="int64")},
    )
    assert list(sdk_message([datum]).data[0].loss_fn_inputs["target_tokens"].shape) == []
    assert parse(sdk_body([datum])).data[0].loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4]


def test_loss_fn_config_prefers_v2_and_keeps_strings() -> None:
    data = [ce_datum([1, 2])]
    numeric = parse(sdk_body(data, loss_fn="ppo", config={"clip_low_threshold": 0.7}))
    assert numeric.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7)}
    mixed = parse(sdk_body(data, loss_fn="dro", config={"beta": 0.05, "mode": "x:y"}))
    assert mixed.loss_fn_config == {"beta": pytest.approx(0.05), "mode": "x:y"}
    assert isinstance(mixed.loss_fn_config["beta"], float)
    # an older client writes the legacy map only
    msg = sdk_message(data, loss_fn="ppo")
    msg.loss_fn_config["clip_high_threshold"] = 1.3
    assert parse(msg.SerializeToString()).loss_fn_config == {"clip_high_threshold": 1.3}
    assert parse(sdk_body(data, config={})).loss_fn_config is None


def test_multi_frame_zstd_body() -> None:
    body = sdk_body([ce_datum([1, 2, 3])])
    cctx = zstandard.ZstdCompressor(write_content_size=False)
    two_frames = cctx.compress(body[:10]) + cctx.compress(body[10:])
    assert parse(two_frames, compress=True).data[0].model_input.tolist() == [1, 2, 3]


# ---------------------------------------------------------------- bad requests


def bad(body: bytes, match: str, encoding: str | None = None, **kwargs) -> None:
    with pytest.raises(InputError, match=match):
        parse_forward_backward(body, encoding, Limits(**kwargs))


def test_garbage_body() -> None:
    bad(b"\xff\xff\xff\xff not a protobuf", r"body: not a ForwardBackwardRequest protobuf")
    bad(b"\x28\xb5\x2f\xfd garbage", r"body: invalid zstd data", "zstd")
    bad(b"", r"data: at least one datum", None)
    bad(b"abc", r"Content-Encoding: unsupported 'gzip'", "gzip")


def test_image_chunk_is_rejected() -> None:
    datum = tt.Datum(
        model_input=tt.ModelInput(
            chunks=[
                tt.EncodedTextChunk(tokens=[1]),
                tt.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4),
            ]
        ),
        loss_fn_inputs={"target_tokens": [1, 2, 3, 4, 5], "weights": [1.0] * 5},
    )
    bad(
        sdk_body([ce_datum([1]), datum]),
        r"^data\[1\]\.model_input\.chunks\[1\]: only encoded_text chunks are supported",
    )


def test_dense_length_mismatch_names_the_input() -> None:
    msg = sdk_message([ce_datum([1, 2]), ce_datum([3, 4, 5])])
    weights = msg.data[1].loss_fn_inputs["weights"]
    weights.dense = weights.dense[:-4]
    bad(msg.SerializeToString(), r"^data\[1\]\.loss_fn_inputs\['weights'\]: 8 bytes hold 2")
    weights.dense = weights.dense + b"\x00"
    bad(msg.SerializeToString(), r"^data\[1\]\.loss_fn_inputs\['weights'\]: 9 bytes")
    msg.data[1].loss_fn_inputs["weights"].dtype = pb.DTYPE_UNSPECIFIED
    bad(msg.SerializeToString(), r"^data\[1\]\.loss_fn_inputs\['weights'\]: unsupported dtype")


def test_float_targets_name_the_datum() -> None:
    msg = sdk_message([ce_datum([1, 2])])
    msg.data[0].loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dense=np.array([1, 2], "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[2])
    )
    bad(msg.SerializeToString(), r"^data\[0\]\.loss_fn_inputs\['target_tokens'\]: expected int")


def sparse_message() -> pb.ForwardBackwardRequest:
    targets = torch.zeros(4, 5, dtype=torch.int64)
    targets[0, 1], targets[2, 3] = 7, 8
    datum = tt.Datum(
        model_input=tt.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": targets},
    )
    msg = sdk_message([datum])
    assert msg.data[0].loss_fn_inputs["target_tokens"].WhichOneof("encoding") == "sparse_csr"
    return msg


@pytest.mark.parametrize(
    ("crow", "col", "shape", "match"),
    [
        ([0, 1, 1, 3, 2], None, None, r"\.crow_indices: expected 5 non-decreasing"),
        ([0, 1, 1, 2], None, None, r"\.crow_indices: expected 5"),
        ([1, 1, 1, 2, 2], None, None, r"\.crow_indices"),
        ([0, 1, 1, 2, 3], None, None, r"\.crow_indices: .* to 2"),
        (None, [1, 5], None, r"\.col_indices: expected 2 column indices in \[0, 5\)"),
        (None, [1, -1], None, r"\.col_indices"),
        ([0, 2, 2, 2, 2], [3, 3], None, r"\.col_indices: must be strictly increasing"),
        (None, None, [20], r": sparse_csr needs a 2-D shape"),
        (None, None, [], r": sparse_csr needs a 2-D shape"),
        (
            None,
            None,
            [1 << 20, 1 << 20],
            r": 1099511627776 elements once dense; the limit is 4194304",
        ),
    ],
)
def test_bad_sparse_tensor(crow, col, shape, match) -> None:
    msg = sparse_message()
    tensor = msg.data[0].loss_fn_inputs["target_tokens"]
    if crow is not None:
        tensor.sparse_csr.crow_indices = np.array(crow, "<i8").tobytes()
    if col is not None:
        tensor.sparse_csr.col_indices = np.array(col, "<i8").tobytes()
    if shape is not None:
        del tensor.shape[:]
        tensor.shape.extend(shape)
    bad(msg.SerializeToString(), r"^data\[0\]\.loss_fn_inputs\['target_tokens'\]" + match)


def test_sparse_with_empty_rows_is_fine() -> None:
    msg = sparse_message()
    assert parse(msg.SerializeToString()).data[0].loss_fn_inputs["target_tokens"].tolist() == [
        [0, 7, 0, 0, 0],
        [0, 0, 0, 0, 0],
        [0, 0, 0, 8, 0],
        [0, 0, 0, 0, 0],
    ]


@pytest.mark.parametrize("content_size", [True, False])
def test_zstd_bomb_is_stopped_at_the_limit(content_size: bool) -> None:
    bomb = zstandard.ZstdCompressor(level=19, write_content_size=content_size).compress(
        bytes(64 << 20)
    )
    assert len(bomb) < 64 << 10
    bad(
        bomb,
        r"body: decompressed size exceeds the limit of 1048576 bytes",
        "zstd",
        max_bytes=1 << 20,
    )


def test_size_limit_and_truncation() -> None:
    body = sdk_body([ce_datum(list(range(100)))])
    bad(body, r"body: \d+ bytes exceeds the limit of 100 bytes", max_bytes=100)
    frame = zstandard.ZstdCompressor().compress(body)
    bad(frame[:-3], r"body: truncated zstd frame", "zstd")
    assert parse(frame, compress=True, max_bytes=len(body)).data[0].model_input.numel() == 100


def test_negative_seq_id() -> None:
    msg = sdk_message([ce_datum([1])])
    msg.seq_id = -1
    bad(msg.SerializeToString(), r"^seq_id: expected an integer >= 1, got -1")
    msg.seq_id = 0  # seq 0 is the model's creation: never a forward_backward
    bad(msg.SerializeToString(), r"^seq_id: expected an integer >= 1, got 0")


# ---------------------------------------------------------------- forward_backward output


def test_output_round_trips_through_the_sdk() -> None:
    outputs = [
        {"logprobs": torch.tensor([-0.5, -1.0, -2.0]), "loss": torch.tensor(3.5)},
        {"logprobs": torch.tensor([-0.25]), "loss": torch.tensor(0.25)},
        {"logprobs": torch.tensor([-1.0, -3.0]), "loss": torch.tensor(4.0), "note": "x"},
    ]
    metrics = {"loss:sum": 7.75, "num_tokens:sum": 6.0}
    decoded = deserialize_forward_backward_output(
        encode_forward_backward_output(ForwardResult(outputs=outputs, metrics=metrics))
    )
    assert decoded.loss_fn_output_type == "ArrayRecord"
    assert decoded.metrics == metrics
    assert len(decoded.loss_fn_outputs) == 3
    for out, got in zip(outputs, decoded.loss_fn_outputs, strict=True):
        assert set(got) == {"logprobs", "loss"}  # only tensors every datum has
        assert got["logprobs"].dtype == "float32"
        assert got["logprobs"].shape == list(out["logprobs"].shape)
        assert got["logprobs"].to_numpy().tolist() == out["logprobs"].tolist()
        # a 0-d value can only come back as shape [1]: leading = elements / prod([])
        assert got["loss"].shape == [1]
        assert got["loss"].to_numpy().tolist() == [out["loss"].item()]


def test_output_offsets_are_bytes_and_num_datums_is_set() -> None:
    outputs = [{"logprobs": torch.zeros(n)} for n in (3, 0, 2)]
    msg = pb.ForwardBackwardOutput.FromString(
        encode_forward_backward_output(ForwardResult(outputs=outputs, metrics={"loss:sum": 0.0}))
    )
    (record,) = msg.loss_fn_outputs
    assert record.num_datums == 3
    field = record.fields["logprobs"]
    assert np.frombuffer(field.offsets, "<i8").tolist() == [0, 12, 12, 20]
    assert (field.dtype, list(field.trailing_shape)) == (pb.DTYPE_FLOAT32, [])


def test_top_k_and_mixed_shapes_keep_request_order() -> None:
    outputs = [
        {"logprobs": torch.tensor([-1.0, -2.0])},
        {"logprobs": torch.arange(6, dtype=torch.float32).reshape(3, 2)},
        {"logprobs": -torch.arange(4, dtype=torch.float32).reshape(2, 2)},
        {"logprobs": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
        {"logprobs": torch.tensor([-0.5], dtype=torch.bfloat16)},
    ]
    raw = encode_forward_backward_output(ForwardResult(outputs=outputs, metrics={"loss:sum": 1.0}))
    assert len(pb.ForwardBackwardOutput.FromString(raw).loss_fn_outputs) == 4
    decoded = deserialize_forward_backward_output(raw)
    assert len(decoded.loss_fn_outputs) == 5
    for out, got in zip(outputs, decoded.loss_fn_outputs, strict=True):
        assert got["logprobs"].shape == list(out["logprobs"].shape)
        assert got["logprobs"].to_numpy().tolist() == out["logprobs"].float().tolist()


def test_output_metrics_need_one_colon_and_empty_output() -> None:
    for key in ("loss", "loss:sum:x"):
        with pytest.raises(ValueError, match="exactly one ':'"):
            encode_forward_backward_output(ForwardResult(outputs=[], metrics={key: 1.0}))
    decoded = deserialize_forward_backward_output(
        encode_forward_backward_output(ForwardResult(outputs=[], metrics={"loss:sum": 0.0}))
    )
    assert decoded.loss_fn_outputs == [] and decoded.metrics == {"loss:sum": 0.0}


# ---------------------------------------------------------------- sample response


def test_sample_response_round_trips_through_the_sdk() -> None:
    sequences = [
        SampledSeq(tokens=[5, 151_645], logprobs=[-0.5, -0.125], stop_reason="stop"),
        SampledSeq(
            tokens=[9, 8, 7],
            logprobs=[-1.0, -2.0, -3.0],
            stop_reason="length",
            topk=[[(9, -1.0), (3, -1.5)], [(8, -2.0)], [(7, -3.0), (1, -4.0)]],
        ),
    ]
    prompt = [None, -1.25, -0.5]
    topk_prompt = [None, [(4, -1.25), (2, -2.0)], [(6, -0.5)]]
    decoded = deserialize_sample_response(encode_sample_response(sequences, prompt, topk_prompt))
    assert [s.tokens for s in decoded.sequences] == [s.tokens for s in sequences]
    assert [s.logprobs for s in decoded.sequences] == [s.logprobs for s in sequences]
    assert [s.stop_reason for s in decoded.sequences] == ["stop", "length"]
    assert decoded.sequences[0].topk_logprobs is None
    assert decoded.sequences[1].topk_logprobs == sequences[1].topk
    assert decoded.prompt_logprobs == prompt
    assert math.isnan(decoded.prompt_logprobs_np[0])
    assert decoded.topk_prompt_logprobs == topk_prompt
    assert decoded.topk_prompt_logprobs_np.token_ids.tolist() == [[0, 0], [4, 2], [6, 0]]
    assert decoded.topk_prompt_logprobs_np.logprobs[0].tolist() == [-99999.0, -99999.0]


def test_sample_response_without_extras() -> None:
    decoded = deserialize_sample_response(
        encode_sample_response([SampledSeq(tokens=[1], logprobs=[-0.5], stop_reason="length")])
    )
    assert decoded.prompt_logprobs is None and decoded.topk_prompt_logprobs is None
    assert decoded.sequences[0].logprobs == [-0.5]
    with pytest.raises(ValueError, match=r"sequences\[0\]: 1 logprobs for 2 tokens"):
        encode_sample_response([SampledSeq(tokens=[1, 2], logprobs=[-0.5], stop_reason="stop")])
