"""One request of the embedded engine: its validation, its state while it waits and runs, the
tokens drawn for it, and its result.

The scheduler (:class:`~furlong.rollout.engine.EmbeddedEngine`) owns the requests; the model
runner writes only their prompt scores and routed-expert rows
(:class:`~furlong.rollout.model_runner.SequenceState`).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from furlong.errors import InputError
from furlong.rollout.base import FinishReason, GenerateResult
from furlong.rollout.sampling import Draw, SamplingParams
from furlong.rollout.sampling_mask import SamplingMask


@dataclass
class RequestState:
    request_id: int | str
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    arrival: int  # the engine's running count of requests: the order they came in
    future: Future = field(default_factory=Future)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    kept: list[list[int]] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None
    prompt_top: list[list[tuple[int, float]] | None] | None = None
    prompt_target: torch.Tensor | None = None  # log-probs of params.prompt_target_ids
    routing: list[torch.Tensor] = field(default_factory=list)  # [positions, layers, top_k] parts


def check_request(
    index: int,
    prompt: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    context_length: int | None,
    moe: bool,
) -> None:
    """Raise :class:`InputError` (naming ``prompts[index]`` / ``params[index]``) unless the
    request fits the model: token ids in its vocabulary, prompt targets one row per predicted
    position, routed experts only from an MoE model, prompt + ``max_tokens`` within the
    context (refused before any KV cache is allocated)."""
    if not isinstance(params, SamplingParams):
        raise InputError(f"params[{index}]: expected SamplingParams, got {type(params)}")
    if not prompt:
        raise InputError(f"prompts[{index}]: empty")
    bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
    if bad:
        raise InputError(f"prompts[{index}]: token id {bad[0]} outside [0, {vocab_size})")
    targets = params.prompt_target_ids
    if targets is not None:
        if targets.shape[0] != len(prompt) - 1:
            raise InputError(
                f"params[{index}].prompt_target_ids: {targets.shape[0]} rows for a prompt of "
                f"{len(prompt)} tokens; expected len(prompt) - 1 = {len(prompt) - 1}"
            )
        values = targets.values() if targets.layout == torch.sparse_csr else targets
        if values.numel() and int(values.max()) >= vocab_size:
            raise InputError(
                f"params[{index}].prompt_target_ids: token id {int(values.max())} outside "
                f"[0, {vocab_size})"
            )
    if params.return_routed_experts and not moe:
        raise InputError(f"params[{index}].return_routed_experts: the model has no MoE routers")
    if context_length is not None and len(prompt) + params.max_tokens > context_length:
        raise InputError(
            f"params[{index}].max_tokens: {len(prompt)} prompt tokens + max_tokens "
            f"{params.max_tokens} exceed the model's context of {context_length}"
        )


def record(request: RequestState, d: Draw, tokenizer: Any) -> FinishReason | None:
    """Append a drawn token (with its log-prob, kept set and top log-probs) to the request;
    the finish reason when it ends the request."""
    request.output.append(d.token)
    request.logprobs.append(d.logprob)
    if d.kept is not None:
        request.kept.append(d.kept.tolist())
    if d.top:
        request.top.append(list(d.top))
    if d.token in request.stop_ids:
        return "stop"
    if request.params.stop and _hits_stop_string(request, tokenizer):
        return "stop"
    if len(request.output) >= request.params.max_tokens:
        return "length"
    return None


def _hits_stop_string(request: RequestState, tokenizer: Any) -> bool:
    """A stop string that ends in the newest token. Earlier text was checked at earlier
    steps, so only a tail is decoded: a string of L characters spans at most 4L byte-level
    tokens (plus one that may end it)."""
    longest = max(map(len, request.params.stop))
    text = tokenizer.decode(request.output[-(4 * longest + 1) :])
    return any(s in text for s in request.params.stop)


def result(
    request: RequestState, reason: FinishReason, version: int, routed: torch.Tensor | None
) -> GenerateResult:
    """The request's result; ``routed``: its routed-expert rows, when it asked for them."""
    params = request.params
    return GenerateResult(
        request_id=request.request_id,
        prompt_ids=request.prompt,
        output_ids=list(request.output),
        output_logprobs=list(request.logprobs),
        finish_reason=reason,
        sampling_mask=SamplingMask.from_lists(request.kept) if request.kept else None,
        weight_version=version,
        prompt_logprobs=request.prompt_logprobs if params.prompt_logprobs else None,
        prompt_top_logprobs=request.prompt_top,
        top_logprobs=list(request.top) if params.top_logprobs else None,
        routed_experts=routed,
        routed_experts_start=params.routed_experts_start,
        prompt_target_logprobs=request.prompt_target,
    )
