"""What the front doors need from a rollout engine, as small protocols: ``Generation``,
``WeightUpdates``, ``Pausing`` (with the colocation hand-off's memory calls) and ``Requests``;
and the three combinations the front doors ask the registry (``furlong.rollout.registry``)
for: the RL loop's :class:`RolloutEngine`, the session server's :class:`SessionEngine` and the
Tinker service's :class:`SamplingEngine`. The engine runs in process
(:class:`~furlong.rollout.engine.EmbeddedEngine`), behind SGLang's HTTP protocol
(:class:`~furlong.rollout.sglang_client.SGLangClient`), or as Ray actors."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast, get_args, runtime_checkable
from urllib.parse import urlsplit

import torch

from furlong.errors import InputError
from furlong.rollout.sampling import SamplingParams
from furlong.rollout.sampling_mask import SamplingMask

FinishReason = Literal["stop", "length", "abort"]
# abort: in-flight requests end now with their partial output; retract: they are requeued and
# their prefix recomputed under the new weights; in_place: they are frozen with their KV cache.
PauseMode = Literal["abort", "retract", "in_place"]
MemoryTag = Literal["kv_cache", "weights"]
MemoryBytes = dict[str, int]  # "weights", "kv_cache", "mirror"
PAUSE_MODES: tuple[PauseMode, ...] = get_args(PauseMode)
MEMORY_TAGS: tuple[MemoryTag, ...] = get_args(MemoryTag)


@dataclass(frozen=True)
class GenerateResult:
    request_id: int | str
    prompt_ids: list[int]
    output_ids: list[int]  # the terminating token(s) included
    output_logprobs: list[float]  # under the distribution actually sampled from
    finish_reason: FinishReason
    sampling_mask: SamplingMask | None
    weight_version: int  # of the weights the request finished under
    prompt_logprobs: list[float] | None = None  # raw model log-probs, NaN at position 0
    # per prompt position, the N most likely (id, log-prob) of the raw model; None at 0
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per output token
    # MoE: int32 [len(prompt + output) - 1 - start, layers, top_k]; row i = position start + i
    routed_experts: torch.Tensor | None = None
    routed_experts_start: int = 0
    # float32, the shape and layout of params.prompt_target_ids: the raw model log-prob of each
    # named id (row i: prompt position i + 1); NaN where the id is -1 (nothing asked)
    prompt_target_logprobs: torch.Tensor | None = None


Weights = Mapping[str, torch.Tensor] | str | os.PathLike


class Router(Protocol):
    """The engine's view of its model's MoE routing (what routing replay needs to know)."""

    @property
    def is_moe(self) -> bool: ...


@runtime_checkable
class Generation(Protocol):
    """Batches of prompts to results: the RL loop's sampling and evaluation."""

    @property
    def weight_version(self) -> int: ...

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerateResult]:
        """Results in request order; blocks until every request has finished."""
        ...

    def metrics(self) -> dict[str, float]:
        """Counters the RL loop logs with each step, named ``name:reduction`` (a Ray fleet's
        engine restarts); empty for an engine with nothing to count."""
        ...

    def close(self) -> None:
        """Release what the engine holds beyond this process (connections, Ray actors)."""
        ...


@runtime_checkable
class WeightUpdates(Protocol):
    """Weight publication: checked whole first, then copied; the version moves."""

    @property
    def weight_version(self) -> int: ...

    def check_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Raise ``InputError`` for weights that ``update_weights`` would refuse, changing
        nothing (a publisher checks before it pauses generation)."""
        ...

    def update_weights(self, weights: Weights, version: int | None = None) -> int:
        """Publish new weights; returns the new weight version."""
        ...


@runtime_checkable
class Pausing(Protocol):
    """What requests in flight do around a publication (the pause modes), and the memory
    calls of the colocated train/rollout hand-off."""

    def pause(self, mode: PauseMode = "retract") -> None: ...

    def resume(self) -> None: ...

    def abort(self, request_ids: Iterable[int | str] | None = None) -> int: ...

    def offload(self, tags: Iterable[MemoryTag]) -> None: ...

    def onload(self, tags: Iterable[MemoryTag]) -> None: ...

    def memory_bytes(self) -> MemoryBytes:
        """What the engine holds now, for the colocation ledger: live ``weights`` and
        ``kv_cache`` bytes and the ``mirror`` (offloaded weights in host memory); a remote
        engine that cannot see its server's memory reports zeros."""
        ...


@runtime_checkable
class Requests(Protocol):
    """One request at a time under the caller's id, so that it can be aborted alone; and
    what a front end must know to render and check prompts."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def router(self) -> Router: ...

    @property
    def context_length(self) -> int | None:
        """Prompt + ``max_tokens`` must fit in this many tokens (None: not known here)."""
        ...

    def submit(
        self, prompt: Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> Future[GenerateResult]:
        """Queue one request; a bad request raises here, before anything is queued."""
        ...

    def abort(self, request_ids: Iterable[int | str] | None = None) -> int: ...


@runtime_checkable
class RolloutEngine(Generation, WeightUpdates, Pausing, Protocol):
    """The RL loop's engine: generation, publication, and the pause / memory calls."""


@runtime_checkable
class SessionEngine(Requests, WeightUpdates, Pausing, Protocol):
    """The session server's engine: one turn per request, publication under a pause mode."""


@runtime_checkable
class SamplingEngine(Requests, Protocol):
    """The Tinker service's sampler engine, fed by its fair per-tenant queue."""

    @property
    def max_running(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def check_requests(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> None:
        """Validate requests as ``submit`` would, queueing nothing."""
        ...


def protocol_members(protocol: type) -> list[str]:
    """The public members a protocol asks for, its bases' included."""
    names = {
        name
        for cls in protocol.__mro__
        if getattr(cls, "_is_protocol", False) and cls is not Protocol
        for name in vars(cls)
        if not name.startswith("_")
    }
    return sorted(names)


def check_weight_shapes(
    weights: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]]
) -> None:
    """Every tensor names a parameter in ``shapes`` and has its shape, or an InputError."""
    from furlong.shapes import check_names_and_shapes

    check_names_and_shapes(weights, shapes, "update_weights", theirs="the engine's", subset=True)


def no_memory() -> MemoryBytes:
    return {"weights": 0, "kv_cache": 0, "mirror": 0}


def check_pause_mode(mode: str) -> PauseMode:
    if mode not in PAUSE_MODES:
        raise InputError(f"mode: {mode!r} is not one of {list(PAUSE_MODES)}")
    return mode


def check_tags(tags: Iterable[str]) -> list[MemoryTag]:
    tags = [tags] if isinstance(tags, str) else list(tags)
    if not tags:
        raise InputError(f"tags: empty; expected some of {list(MEMORY_TAGS)}")
    for i, tag in enumerate(tags):
        if tag not in MEMORY_TAGS:
            raise InputError(f"tags[{i}]: {tag!r} is not one of {list(MEMORY_TAGS)}")
    return cast(list[MemoryTag], list(dict.fromkeys(tags)))  # each one of MEMORY_TAGS


def check_url(url: Any, field: str) -> str:
    """An ``http(s)://host[:port]`` base URL without a trailing slash, or an InputError."""
    if not isinstance(url, str):
        raise InputError(f"{field}: expected a URL string, got {url!r}")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputError(f"{field}: {url!r} is not an http(s)://host:port URL")
    try:
        parts.port  # noqa: B018 - raises on a non-numeric or out-of-range port
    except ValueError as e:
        raise InputError(f"{field}: {url!r} has a bad port ({e})") from e
    if parts.query or parts.fragment:
        raise InputError(f"{field}: {url!r} has a query or fragment; give the base URL")
    return url.strip().rstrip("/")


def expand_params(
    n: int, params: SamplingParams | Sequence[SamplingParams]
) -> list[SamplingParams]:
    plist = [params] * n if isinstance(params, SamplingParams) else list(params)
    if len(plist) != n:
        raise InputError(f"params: {len(plist)} for {n} prompts")
    return plist
