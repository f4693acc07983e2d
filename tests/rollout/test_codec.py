"""Rollout -> trainer codec: default payloads ignore opt-in fields byte for byte, opt-in
round trips keep dtypes, and the decoder is strict."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load, save

from furlong.errors import InputError
from furlong.rollout.base import GenerateResult
from furlong.rollout.codec import (
    DEFAULT_FIELDS,
    decode_results,
    decode_samples,
    encode_results,
    encode_samples,
    opt_in,
    payload_fields,
)
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


# ---------------------------------------------------------------- transports


def moe_sample() -> Sample:
    """A masked sample with hand-made nonzero routed-expert rows."""
    s = samples()[0]
    rows = torch.arange(1, (s.tokens.numel() - 1) * 4 + 1, dtype=torch.int32).view(-1, 2, 2)
    return s.replace(routed_experts=rows)


def test_allowlists_have_one_order_and_senders_keep_what_they_carry() -> None:
    both = opt_in("routed_experts", "sampling_mask", "routed_experts")
    assert both == (*DEFAULT_FIELDS, "sampling_mask", "routed_experts")
    assert opt_in() == DEFAULT_FIELDS
    assert payload_fields(samples(with_masks=False), DEFAULT_FIELDS) == DEFAULT_FIELDS
    assert payload_fields(samples(), DEFAULT_FIELDS) == MASKED  # carried, so it travels
    assert payload_fields(samples(with_masks=False), both) == both  # asked: null markers


def test_a_receiver_that_did_not_opt_in_is_told_the_field() -> None:
    s = moe_sample()
    payload = encode_samples([s], payload_fields([s], DEFAULT_FIELDS))
    with pytest.raises(InputError, match=r"\['sampling_mask', 'routed_experts'\] the receiver"):
        decode_samples(payload)
    with pytest.raises(InputError, match=r"lacks \['routed_experts'\] it asked for"):
        decode_samples(encode_samples([s], MASKED), opt_in("sampling_mask", "routed_experts"))


def results(with_optional: bool) -> list[GenerateResult]:
    out = []
    for k, s in enumerate(samples(with_masks=with_optional)):
        rows = torch.full((s.tokens.numel() - 1, 2, 3), 5 + k, dtype=torch.int32)
        out.append(
            GenerateResult(
                request_id=f"r{k}" if k else 7,
                prompt_ids=s.tokens[: s.prompt_length].tolist(),
                output_ids=s.response.tolist(),
                output_logprobs=s.rollout_logprobs.tolist(),
                finish_reason=("stop", "length", "abort")[k],
                sampling_mask=s.sampling_mask,
                weight_version=3,
                routed_experts=rows if with_optional else None,
            )
        )
    return out


def test_results_payload_default_bytes_and_opt_in_round_trip() -> None:
    plain, rich = results(False), results(True)
    default = encode_results(plain, payload_fields(plain, DEFAULT_FIELDS))
    assert default == encode_results(rich, DEFAULT_FIELDS)  # the features add no byte
    assert b"sampling_mask" not in default and b"routed_experts" not in default
    assert decode_results(default) == plain
    both = payload_fields(rich, DEFAULT_FIELDS)
    back = decode_results(encode_results(rich, both), both)
    for a, b in zip(rich, back, strict=True):  # every field, masks and routes exactly
        assert torch.equal(a.routed_experts, b.routed_experts)
        assert dataclasses.replace(a, routed_experts=None) == dataclasses.replace(
            b, routed_experts=None
        )
    with pytest.raises(InputError, match=r"\['sampling_mask', 'routed_experts'\] the receiver"):
        decode_results(encode_results(rich, both))
    with pytest.raises(InputError, match="not a generation results payload"):
        decode_results(encode_samples(samples()))


def test_results_the_codec_cannot_hold_are_refused() -> None:
    r = results(True)[1]
    with pytest.raises(InputError, match=r"results\[0\].top_logprobs"):
        encode_results([dataclasses.replace(r, top_logprobs=[[(1, -0.1)]] * 2)])
    with pytest.raises(InputError, match=r"results\[0\].routed_experts_start"):
        encode_results([dataclasses.replace(r, routed_experts_start=2)], opt_in("routed_experts"))
