"""``SamplingParams`` validation: the one seed rule every front door shares (an integer in
``[0, MAX_SEED]``), and wrong types as ``InputError`` naming the field (never a TypeError)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from furlong.errors import InputError
from furlong.rollout.sampling import MAX_SEED, SamplingParams, check_seed, request_generator


def test_every_64_bit_seed_is_accepted_and_draws() -> None:
    for seed in (0, 2**63, MAX_SEED):
        params = SamplingParams(seed=seed)
        assert params.seed == seed
        torch.rand((), generator=request_generator(params.seed))


@pytest.mark.parametrize("seed", [MAX_SEED + 1, 2**80, -1, True, 1.5, "7", [1]])
def test_bad_seeds_name_the_field(seed: object) -> None:
    with pytest.raises(InputError, match=r"^sampling_params\.seed: "):
        SamplingParams(seed=seed)
    with pytest.raises(InputError, match=r"^body\.seed: "):
        check_seed(seed, "body.seed")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"),
        ("temperature", None),
        ("top_p", [0.5]),
        ("min_p", "0"),
        ("max_tokens", True),
        ("top_k", "5"),
        ("routed_experts_start", "3"),
        ("routed_experts_start", -1),
        ("top_logprobs", 1.0),
        ("return_sampling_mask", "false"),
        ("prompt_logprobs", 1),
        ("stop", "END"),
        ("stop", 5),
        ("stop", ("ok", 3)),
        ("stop_token_ids", 5),
        ("stop_token_ids", "12"),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", [-1]),
        ("temperature", math.inf),
    ],
)
def test_wrong_types_are_input_errors_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(InputError, match=rf"^sampling_params\.{field}"):
        SamplingParams(**{field: value})


def test_integer_like_values_are_normalised() -> None:
    params = SamplingParams(seed=np.int64(3), stop_token_ids=[torch.tensor(5)])
    assert type(params.seed) is int and params.seed == 3
    assert params.stop_token_ids == (5,) and type(params.stop_token_ids[0]) is int
