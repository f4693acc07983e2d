"""What furlong refuses from SDK 0.38, through the official SDK on 127.0.0.1: `inflight`
samplers, and image and audio (dmel) chunks, each with an error naming the feature and where it
was; the training client goes on working afterwards."""

from __future__ import annotations

import os

import pytest
from tinker import types

from tests.server.test_sdk import BASE, client, rl_data, serve

os.environ.setdefault("TINKER_TELEMETRY", "0")
pytestmark = pytest.mark.usefixtures("one_thread")
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
DMEL = bytes([0, 2, 1, 8]) + bytes(8)  # a TensorContainer header: uint8 [1, 8], then its data


@pytest.fixture(scope="module")
def server(tmp_path_factory, one_thread):
    with serve(tmp_path_factory.mktemp("srv")) as url:
        yield url


def test_inflight_samplers_are_refused(server) -> None:
    training = client(server).create_lora_training_client(BASE, rank=4).result()
    with pytest.raises(Exception, match="kind: 'inflight' samplers are not supported by furlong"):
        training.save_weights_and_get_sampling_client(kind="inflight").result()
    # the refusal consumed its seq_id: the next save runs at once
    sampler = training.save_weights_and_get_sampling_client().result()
    out = sampler.sample(
        types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2)
    )
    assert len(out.result().sequences[0].tokens) == 2


def with_chunk(datum: types.Datum, chunk: types.ModelInputChunk) -> types.Datum:
    """``datum`` with ``chunk`` spliced in as its second chunk (one more position to predict)."""
    tokens = datum.model_input.to_ints()
    targets = datum.loss_fn_inputs["target_tokens"].to_numpy().tolist()
    chunks = [
        types.EncodedTextChunk(tokens=tokens[:2]),
        chunk,
        types.EncodedTextChunk(tokens=tokens[2:]),
    ]
    return types.Datum(
        model_input=types.ModelInput(chunks=chunks),
        loss_fn_inputs={
            "target_tokens": targets + [0] * chunk.length,
            "weights": [1.0] * (len(targets) + chunk.length),
        },
    )


def test_image_and_audio_chunks_are_refused(server) -> None:
    training = client(server).create_lora_training_client(BASE, rank=4).result()
    text, _ = rl_data(2)
    image = types.ImageChunk(data=PNG, format="png", expected_tokens=1)
    audio = types.DmelChunk(dmel=DMEL)
    for chunk in (image, audio):
        data = [text[0], with_chunk(text[1], chunk)]
        where = rf"data\[1\]\.model_input\.chunks\[1\]: .* got {chunk.type}"
        with pytest.raises(Exception, match=where):
            training.forward_backward(data, "cross_entropy").result()
    sampler = client(server).create_sampling_client(base_model=BASE).result()
    for chunk in (image, audio):
        prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]), chunk])
        with pytest.raises(Exception, match=r"prompt\.chunks\[1\]: only encoded_text chunks"):
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
    # nothing changed: the client trains on
    out = training.forward_backward(text, "cross_entropy").result()
    assert "loss:sum" in out.metrics
