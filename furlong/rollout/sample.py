"""``Sample``: one rollout trajectory, and the operations that keep its per-token fields aligned.

A sample is ``tokens`` (prompt + response) with ``response_length`` response tokens; every
response-aligned field (``loss_mask``, ``rollout_logprobs``, ``sampling_mask``) has exactly
that many positions, and ``routed_experts`` rows cover ``len(tokens) - 1`` positions. Samples
are immutable: every operation returns a new, validated sample, so no mutation can leave the
fields out of step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from furlong.errors import InputError
from furlong.rollout.sampling_mask import SamplingMask
from furlong.types import Datum


def _ints(values: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64).reshape(-1).clone()


def _floats(values: Sequence[float] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float32).reshape(-1).clone()


@dataclass(frozen=True, eq=False)
class Sample:
    tokens: torch.Tensor  # int64 [N]: prompt + response
    response_length: int
    loss_mask: torch.Tensor  # float32 [response_length]: 1 model tokens, 0 environment tokens
    rollout_logprobs: torch.Tensor  # float32 [response_length]: the sampler's log-probs
    reward: float | None = None
    sampling_mask: SamplingMask | None = None  # kept sets, [response_length] positions
    routed_experts: torch.Tensor | None = None  # int32 [len(tokens) - 1, layers, top_k]
    weight_version: int | None = None

    def __post_init__(self) -> None:
        n, r = self.tokens.numel(), self.response_length
        if self.tokens.dim() != 1 or self.tokens.dtype != torch.int64:
            raise InputError("sample.tokens: expected a 1-D int64 tensor")
        if not 0 <= r <= n:
            raise InputError(f"sample.response_length: {r} is outside [0, {n}]")
        for name in ("loss_mask", "rollout_logprobs"):
            if getattr(self, name).shape != (r,):
                shape = tuple(getattr(self, name).shape)
                raise InputError(f"sample.{name}: shape {shape}, expected ({r},)")
        if self.sampling_mask is not None and len(self.sampling_mask) != r:
            raise InputError(
                f"sample.sampling_mask: {len(self.sampling_mask)} positions, expected {r}"
            )
        rows = self.routed_experts
        if rows is not None and (rows.dim() != 3 or rows.shape[0] != max(0, n - 1)):
            raise InputError(
                f"sample.routed_experts: shape {tuple(rows.shape)}, expected "
                f"[{max(0, n - 1)}, layers, top_k]"
            )

    @classmethod
    def from_prompt(cls, prompt: Sequence[int] | torch.Tensor, **fields: Any) -> Sample:
        return cls(_ints(prompt), 0, torch.zeros(0), torch.zeros(0), **fields)

    @property
    def prompt_length(self) -> int:
        return self.tokens.numel() - self.response_length

    @property
    def response(self) -> torch.Tensor:
        return self.tokens[self.prompt_length :]

    def replace(self, **changes: Any) -> Sample:
        return dataclasses.replace(self, **changes)

    def to_datum(self, **response: torch.Tensor) -> Datum:
        """The training datum: ``rollout_logprobs`` as ``logprobs``, plus ``response``
        inputs (``advantages``, ...) over the response positions (see ``Datum.next_token``)."""
        return Datum.next_token(self.tokens, logprobs=self.rollout_logprobs, **response)


def append_sampled(
    sample: Sample,
    tokens: Sequence[int] | torch.Tensor,
    logprobs: Sequence[float] | torch.Tensor,
    sampling_mask: SamplingMask | None = None,
) -> Sample:
    """Append model-sampled tokens (loss mask 1) with their log-probs and kept sets.

    A mask may be started only on an empty response; once started, every append brings one."""
    toks = _ints(tokens)
    return _append(sample, toks, _floats(logprobs), sampling_mask, torch.ones(toks.numel()))


def _append(
    sample: Sample,
    toks: torch.Tensor,
    lps: torch.Tensor,
    sampling_mask: SamplingMask | None,
    loss_mask: torch.Tensor,
) -> Sample:
    if lps.numel() != toks.numel():
        raise InputError(f"append: {toks.numel()} tokens but {lps.numel()} log-probs")
    mask = sample.sampling_mask
    if sampling_mask is not None:
        if len(sampling_mask) != toks.numel():
            raise InputError(
                f"append: sampling mask has {len(sampling_mask)} positions "
                f"for {toks.numel()} tokens"
            )
        if mask is None and sample.response_length > 0:
            raise InputError(
                "append: a sampling mask can only start on an empty response "
                f"(this one has {sample.response_length} tokens without one)"
            )
        mask = sampling_mask if mask is None else SamplingMask.concatenate([mask, sampling_mask])
    elif mask is not None and toks.numel():
        raise InputError("append: the sample carries a sampling mask; these tokens need one too")
    return sample.replace(
        tokens=torch.cat([sample.tokens, toks]),
        response_length=sample.response_length + toks.numel(),
        loss_mask=torch.cat([sample.loss_mask, loss_mask]),
        rollout_logprobs=torch.cat([sample.rollout_logprobs, lps]),
        sampling_mask=mask,
        routed_experts=None,
    )


def append_forced(
    sample: Sample, tokens: Sequence[int] | torch.Tensor, track_mask: bool | None = None
) -> Sample:
    """Append environment tokens (tool output, observations): loss mask 0, log-prob 0, and a
    singleton support each when the sample tracks sampling masks (``track_mask`` may start
    tracking on an empty response)."""
    toks = _ints(tokens)
    tracking = sample.sampling_mask is not None if track_mask is None else track_mask
    mask = SamplingMask.singletons(toks) if tracking else None
    return _append(sample, toks, torch.zeros(toks.numel()), mask, torch.zeros(toks.numel()))


def truncate_response(sample: Sample, n: int) -> Sample:
    """Strip the last ``n`` response tokens, and with them their log-probs, loss mask, kept
    sets and routed-expert rows."""
    if not 0 <= n <= sample.response_length:
        raise InputError(f"truncate: n must be in [0, {sample.response_length}], got {n}")
    keep = sample.response_length - n
    total = sample.tokens.numel() - n
    rows = sample.routed_experts
    return sample.replace(
        tokens=sample.tokens[:total].clone(),
        response_length=keep,
        loss_mask=sample.loss_mask[:keep].clone(),
        rollout_logprobs=sample.rollout_logprobs[:keep].clone(),
        sampling_mask=None if sample.sampling_mask is None else sample.sampling_mask.prefix(keep),
        routed_experts=None if rows is None else rows[: max(0, total - 1)].clone(),
    )


def merge_turns(first: Sample, second: Sample) -> Sample:
    """One trajectory from two turns, ``second`` extending ``first``: the tokens between
    ``first``'s end and ``second``'s response are observations (loss mask 0, singletons)."""
    n_first = first.tokens.numel()
    if second.tokens.numel() < n_first or not torch.equal(second.tokens[:n_first], first.tokens):
        raise InputError("merge: the second turn does not extend the first turn's tokens")
    if second.prompt_length < n_first:
        raise InputError("merge: the second turn's response overlaps the first turn's tokens")
    if (first.sampling_mask is None) != (second.sampling_mask is None):
        raise InputError("merge: either every turn carries a sampling mask or none does")
    observation = second.tokens[n_first : second.prompt_length]
    with_observation = append_forced(first, observation)
    merged = _append(
        with_observation,
        second.response.clone(),
        second.rollout_logprobs.clone(),
        second.sampling_mask,
        second.loss_mask.clone(),  # keeps turn 2's own environment tokens at 0
    )
    return merged.replace(
        reward=second.reward if second.reward is not None else first.reward,
        routed_experts=second.routed_experts,
        weight_version=second.weight_version,
    )


def reset_for_retry(sample: Sample) -> Sample:
    """Back to the prompt: response, log-probs, kept sets and routing are dropped."""
    return truncate_response(sample, sample.response_length).replace(
        sampling_mask=None, reward=None, routed_experts=None
    )
