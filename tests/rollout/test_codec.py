"""Rollout -> trainer codec: default payloads ignore opt-in fields byte for byte, opt-in
round trips keep dtypes, and the decoder is strict."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load, save

from furlong.errors import InputError
from furlong.rollout.codec import DEFAULT_FIELDS, decode_samples, encode_samples
from furlong.rollout.sample import Sample, append_forced, append_sampled
from furlong.rollout.sampling_mask import SamplingMask

MASKED = (*DEFAULT_FIELDS, "sampling_mask")


def samples(with_masks: bool = True) -> list[Sample]:
    out = []
    for k in range(3):
        s = Sample.from_prompt([1, 2, 3 + k])
        mask = SamplingMask.from_lists([[7, 8], [9]]) if with_masks else None
        s = append_sampled(s, [7, 9], [-0.5, -0.25 * k], mask)
        s = append_forced(s, [4]).replace(reward=float(k), weight_version=2)
        out.append(s)
    return out


def same(a: Sample, b: Sample, fields) -> None:
    assert torch.equal(a.tokens, b.tokens) and a.response_length == b.response_length
    assert torch.equal(a.loss_mask, b.loss_mask)
    assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    assert a.reward == b.reward and a.weight_version == b.weight_version
    if "sampling_mask" in fields:
        assert a.sampling_mask == b.sampling_mask


def test_default_round_trip_drops_optional_fields() -> None:
    decoded = decode_samples(encode_samples(samples()))
    for a, b in zip(samples(), decoded, strict=True):
        same(a, b, DEFAULT_FIELDS)
        assert b.sampling_mask is None


def test_default_payload_is_byte_identical_without_the_feature() -> None:
    with_masks = encode_samples(samples(with_masks=True))
    without = encode_samples(samples(with_masks=False))
    assert with_masks == without and b"sampling_mask" not in with_masks


def test_opt_in_round_trip_keeps_dtypes_and_nulls() -> None:
    data = samples()
    data[1] = data[1].replace(sampling_mask=None)
    payload = encode_samples(data, MASKED)
    tensors = load(payload)
    assert tensors["sampling_mask.ids.0"].dtype == torch.int32
    assert tensors["sampling_mask.offsets.0"].dtype == torch.int64
    assert "sampling_mask.ids.1" not in tensors
    decoded = decode_samples(payload, MASKED)
    for a, b in zip(data, decoded, strict=True):
        same(a, b, MASKED)
    assert decoded[1].sampling_mask is None


def test_routed_experts_opt_in() -> None:
    s = samples()[0]
    rows = torch.arange((s.tokens.numel() - 1) * 4, dtype=torch.int32).view(-1, 2, 2)
    s = s.replace(routed_experts=rows)
    fields = (*DEFAULT_FIELDS, "routed_experts")
    (back,) = decode_samples(encode_samples([s], fields), fields)
    assert torch.equal(back.routed_experts, rows) and back.routed_experts.dtype == torch.int32


def test_mismatched_allowlists_fail_loudly() -> None:
    with pytest.raises(InputError, match="allowlists must match"):
        decode_samples(encode_samples(samples(), MASKED))  # receiver did not opt in
    with pytest.raises(InputError, match="allowlists must match"):
        decode_samples(encode_samples(samples()), MASKED)


def _tampered(edit) -> bytes:
    payload = encode_samples(samples(), MASKED)
    header = json.loads(payload[8 : 8 + int.from_bytes(payload[:8], "little")])
    tensors = dict(load(payload))
    edit(tensors)
    return save(tensors, metadata=header["__metadata__"])


def test_wrong_dtype_and_unreferenced_tensors_are_rejected() -> None:
    def to_int64(t):
        t["sampling_mask.ids.0"] = t["sampling_mask.ids.0"].to(torch.int64)

    with pytest.raises(InputError, match="sampling_mask.ids.0.*dtype"):
        decode_samples(_tampered(to_int64), MASKED)

    def add_extra(t):
        t["stowaway.0"] = torch.zeros(2)

    with pytest.raises(InputError, match="stowaway"):
        decode_samples(_tampered(add_extra), MASKED)

    def drop(t):
        del t["tokens.2"]

    with pytest.raises(InputError, match="misses tensor 'tokens.2'"):
        decode_samples(_tampered(drop), MASKED)
    with pytest.raises(InputError, match="not safetensors"):
        decode_samples(b"garbage", MASKED)
    with pytest.raises(InputError, match="unknown"):
        encode_samples(samples(), (*DEFAULT_FIELDS, "nope"))


def test_corrupted_payloads_raise_value_error_only() -> None:
    """Fuzz: random byte flips and truncations give a ValueError or decode, never anything else."""
    import random

    payload = encode_samples(samples(), MASKED)
    rng = random.Random(0)
    outcomes = {"decoded": 0, "rejected": 0}
    for trial in range(600):
        data = bytearray(payload)
        if trial % 5 == 0:
            data = data[: rng.randrange(len(data))]
        else:
            for _ in range(rng.randint(1, 4)):
                pos = rng.randrange(len(data))
                data[pos] = rng.randrange(256)
        try:
            decode_samples(bytes(data), MASKED)
            outcomes["decoded"] += 1
        except ValueError:
            outcomes["rejected"] += 1
    assert outcomes["rejected"] > 100  # the fuzzer really hit the parser
