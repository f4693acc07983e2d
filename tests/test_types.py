"""Datum.next_token: the one teacher-forcing rule (inputs = tokens[:-1], targets = tokens[1:],
response inputs right-aligned over the last target positions, zeros over the prompt's)."""

from __future__ import annotations

import pytest
import torch

from furlong.errors import InputError
from furlong.rollout.sample import Sample
from furlong.types import Datum


def test_response_inputs_cover_the_last_target_positions() -> None:
    tokens = [11, 12, 13, 21, 22]  # prompt of 3, response of 2
    d = Datum.next_token(tokens, advantages=torch.tensor([0.5, -2.0]))
    assert d.model_input.tolist() == [11, 12, 13, 21]
    assert d.loss_fn_inputs["target_tokens"].tolist() == [12, 13, 21, 22]
    # position 2 (input 13) predicts 21, the first response token
    assert d.loss_fn_inputs["advantages"].tolist() == [0.0, 0.0, 0.5, -2.0]


def test_a_full_length_input_and_a_sample() -> None:
    d = Datum.next_token(torch.tensor([5, 6, 7]), weights=torch.tensor([0.25, 1.0]))
    assert d.loss_fn_inputs["weights"].tolist() == [0.25, 1.0]
    sample = Sample(torch.tensor([1, 2, 3, 4]), 2, torch.ones(2), torch.tensor([-0.5, -1.5]))
    d = sample.to_datum(advantages=torch.tensor([1.0, 3.0]))
    assert d.loss_fn_inputs["logprobs"].tolist() == [0.0, -0.5, -1.5]
    assert d.loss_fn_inputs["advantages"].tolist() == [0.0, 1.0, 3.0]


@pytest.mark.parametrize(
    "inputs",
    [
        {"advantages": torch.ones(4)},  # longer than the 3 target positions
        {"advantages": torch.ones(2), "logprobs": torch.ones(1)},  # unequal lengths
    ],
)
def test_misaligned_inputs_are_refused(inputs) -> None:
    with pytest.raises(InputError, match="response lengths"):
        Datum.next_token([1, 2, 3, 4], **inputs)
