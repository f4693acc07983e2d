"""Sample lifecycle: appends, forced tokens, truncation, merge and reset keep every
response-aligned field (log-probs, loss mask, sampling mask, routed rows) in step."""

from __future__ import annotations

import pytest
import torch

from furlong.errors import InputError
from furlong.rollout.sample import (
    Sample,
    append_forced,
    append_sampled,
    merge_turns,
    reset_for_retry,
    truncate_response,
)
from furlong.rollout.sampling_mask import SamplingMask

PROMPT = [10, 11, 12]


def sampled_turn(prompt=PROMPT) -> Sample:
    s = Sample.from_prompt(prompt)
    s = append_sampled(s, [20, 21], [-0.5, -1.5], SamplingMask.from_lists([[20, 3], [21]]))
    return append_sampled(s, [22], [-0.25], SamplingMask.from_lists([[22, 4, 5]]))


def test_appends_concatenate_aligned_fields() -> None:
    s = sampled_turn()
    assert s.tokens.tolist() == PROMPT + [20, 21, 22] and s.response_length == 3
    assert s.rollout_logprobs.tolist() == [-0.5, -1.5, -0.25]
    assert s.loss_mask.tolist() == [1, 1, 1]
    assert s.sampling_mask.to_lists() == [[20, 3], [21], [22, 4, 5]]


def test_mask_may_start_only_on_an_empty_response() -> None:
    s = append_sampled(Sample.from_prompt(PROMPT), [20], [-1.0])
    with pytest.raises(InputError, match="only start on an empty response"):
        append_sampled(s, [21], [-1.0], SamplingMask.from_lists([[21]]))
    with pytest.raises(InputError, match="need one too"):
        append_sampled(sampled_turn(), [23], [-1.0])
    with pytest.raises(InputError, match="positions for 2 tokens"):
        append_sampled(sampled_turn(), [23, 24], [-1.0, -1.0], SamplingMask.from_lists([[23]]))


def test_forced_tokens_get_singletons_and_zero_loss_mask() -> None:
    s = append_forced(sampled_turn(), [30, 31])
    assert s.sampling_mask.to_lists()[-2:] == [[30], [31]]
    assert s.loss_mask.tolist() == [1, 1, 1, 0, 0]
    assert s.rollout_logprobs.tolist()[-2:] == [0.0, 0.0]
    started = append_forced(Sample.from_prompt(PROMPT), [30], track_mask=True)
    assert started.sampling_mask.to_lists() == [[30]]
    assert append_forced(Sample.from_prompt(PROMPT), [30]).sampling_mask is None


def test_truncation_cuts_every_field_together() -> None:
    s = append_forced(sampled_turn(), [30, 31])
    n = s.tokens.numel()
    s = s.replace(routed_experts=torch.arange((n - 1) * 2 * 2, dtype=torch.int32).view(n - 1, 2, 2))
    t = truncate_response(s, 3)
    assert t.tokens.tolist() == PROMPT + [20, 21] and t.response_length == 2
    assert t.rollout_logprobs.tolist() == [-0.5, -1.5] and t.loss_mask.tolist() == [1, 1]
    assert t.sampling_mask.to_lists() == [[20, 3], [21]]
    assert torch.equal(t.routed_experts, s.routed_experts[: t.tokens.numel() - 1])
    with pytest.raises(InputError, match="truncate"):
        truncate_response(s, 6)


def test_merge_inserts_observation_singletons() -> None:
    first = sampled_turn()
    observation = [40, 41]
    second = append_sampled(
        Sample.from_prompt(first.tokens.tolist() + observation),
        [50, 51],
        [-2.0, -3.0],
        SamplingMask.from_lists([[50, 1], [51, 2, 3]]),
    ).replace(reward=1.0)
    merged = merge_turns(first, second)
    assert merged.tokens.tolist() == second.tokens.tolist()
    assert merged.response_length == 3 + 2 + 2 and merged.prompt_length == len(PROMPT)
    assert merged.sampling_mask.to_lists() == (
        [[20, 3], [21], [22, 4, 5], [40], [41], [50, 1], [51, 2, 3]]
    )
    assert merged.loss_mask.tolist() == [1, 1, 1, 0, 0, 1, 1]
    assert merged.rollout_logprobs.tolist() == [-0.5, -1.5, -0.25, 0, 0, -2.0, -3.0]
    assert merged.reward == 1.0


def test_merge_rejects_mixed_mask_presence_and_non_extensions() -> None:
    first = sampled_turn()
    plain = append_sampled(Sample.from_prompt(first.tokens.tolist() + [40]), [50], [-1.0])
    with pytest.raises(InputError, match="every turn carries a sampling mask or none"):
        merge_turns(first, plain)
    other = sampled_turn(prompt=[9, 9, 9])
    with pytest.raises(InputError, match="does not extend"):
        merge_turns(first, other)


def test_reset_clears_mask_and_response() -> None:
    r = reset_for_retry(sampled_turn().replace(reward=0.5))
    assert r.tokens.tolist() == PROMPT and r.response_length == 0
    assert r.sampling_mask is None and r.reward is None and r.rollout_logprobs.numel() == 0


def test_construction_validates_alignment() -> None:
    with pytest.raises(InputError, match="loss_mask"):
        Sample(torch.tensor([1, 2, 3]), 2, torch.ones(1), torch.zeros(2))
    with pytest.raises(InputError, match="sampling_mask"):
        Sample(
            torch.tensor([1, 2, 3]),
            2,
            torch.ones(2),
            torch.zeros(2),
            sampling_mask=SamplingMask.from_lists([[1]]),
        )
    with pytest.raises(InputError, match="routed_experts"):
        Sample(
            torch.tensor([1, 2, 3]),
            1,
            torch.ones(1),
            torch.zeros(1),
            routed_experts=torch.zeros(3, 2, 2, dtype=torch.int32),
        )
    with pytest.raises(InputError, match="response_length"):
        Sample(torch.tensor([1]), 2, torch.ones(2), torch.zeros(2))
