"""Sampling parameters and the per-position sampling step of the rollout engine.

The step turns one row of fp32 logits into a token, the log-prob of that token under the
distribution actually sampled from (after temperature, top-k, top-p and min-p, renormalised
over the kept set), and optionally the kept set itself, the thing the trainer replays.
Each request draws from its own seeded generator with inverse-CDF sampling, so a request's
tokens do not depend on which other requests share its batch.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from furlong.errors import InputError

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64-bit unsigned seeds


def check_seed(seed: object, field: str = "seed") -> int:
    """The one rule for request seeds (every front door applies it): an integer, not a bool,
    in ``[0, MAX_SEED]``. ``field`` names it in the :class:`InputError`."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise InputError(f"{field}: expected an integer, got {seed!r}")
    value = int(seed)
    if not 0 <= value <= MAX_SEED:
        raise InputError(f"{field}: must be in [0, {MAX_SEED}], got {seed}")
    return value


def fit_max_tokens(
    asked: int | None, prompt_len: int, context: int | None, cap: int, field: str = "max_tokens"
) -> int:
    """A request's ``max_tokens``: at most ``cap`` and what the model's context leaves after the
    prompt, which is also the default when the client asks for none. Front ends call it before
    anything is queued, so an oversized request never reaches the engine."""
    room = cap
    if context is not None:
        if prompt_len >= context:
            raise InputError(
                f"prompt: {prompt_len} tokens leave no room in the model's context of {context}"
            )
        room = min(cap, context - prompt_len)
    if asked is None:
        return room
    if asked > room:
        raise InputError(
            f"{field}: {asked} is more than the {room} this request may generate "
            f"({prompt_len} prompt tokens, context {context}, server cap {cap})"
        )
    return asked


def _check_int(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputError(f"sampling_params.{field}: expected an integer, got {value!r}")


def _check_real(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputError(f"sampling_params.{field}: expected a number, got {value!r}")


def _token_ids(ids: object) -> tuple[int, ...]:
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise InputError(f"sampling_params.stop_token_ids: expected a list of ids, got {ids!r}")
    out = []
    for i, t in enumerate(ids):
        try:  # ints, numpy ints and one-element integer tensors; not bools, floats or text
            value = None if isinstance(t, bool) else operator.index(t)
        except TypeError:
            value = None
        if value is None or value < 0:
            raise InputError(f"sampling_params.stop_token_ids[{i}]: expected an id >= 0, got {t!r}")
        out.append(value)
    return tuple(out)


def csr_tensor(
    crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]
) -> torch.Tensor:
    """A sparse CSR tensor from indices already checked (``prompt_target_ids`` and its result
    keep a request's layout), without torch's "beta state" notice, as the tinker SDK does."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"Sparse CSR tensor support is in beta state", category=UserWarning
        )
        return torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False)


def _check_target_ids(ids: object) -> None:
    """What ``prompt_target_ids`` can be checked for without the prompt and the model (the
    engine checks its rows against the prompt and its ids against the vocabulary)."""
    where = "sampling_params.prompt_target_ids"
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64:
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise InputError(f"{where}: expected an int64 tensor of token ids, got {got}")
    if ids.layout not in (torch.strided, torch.sparse_csr) or ids.dim() != 2:
        raise InputError(
            f"{where}: expected a 2-D dense or sparse CSR tensor [len(prompt) - 1, K], "
            f"got {ids.dim()}-D {ids.layout}"
        )
    if ids.shape[1] < 1:
        raise InputError(f"{where}: K (ids per position) must be >= 1, got shape {list(ids.shape)}")
    values = ids.values() if ids.layout == torch.sparse_csr else ids
    if values.numel() and int(values.min()) < -1:
        raise InputError(f"{where}: ids must be >= 0, or -1 for none; got {int(values.min())}")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # <= 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's EOS; (): never on ids
    stop: tuple[str, ...] = ()  # stop strings, checked on the decoded response
    return_sampling_mask: bool = False
    # Reporting options (they do not change what is sampled):
    prompt_logprobs: bool = False  # raw model log-probs of the prompt tokens (NaN at 0)
    prompt_top_logprobs: int = 0  # per prompt position, the N most likely ids (raw model)
    top_logprobs: int = 0  # per generated token, the N most likely ids of the kept distribution
    return_routed_experts: bool = False  # MoE: experts per position and layer (int32 rows)
    routed_experts_start: int = 0  # only rows from this position on (incremental R3)
    # int64 [len(prompt) - 1, K], dense or sparse CSR: row i names ids whose raw model log-probs
    # at prompt position i + 1 are returned (-1: none). Left out of ==, as a tensor has no
    # single truth value; not copied, so do not change it after handing it over.
    prompt_target_ids: torch.Tensor | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        def fail(field: str, why: str) -> None:
            raise InputError(f"sampling_params.{field}: {why}")

        counts = ("top_logprobs", "prompt_top_logprobs", "routed_experts_start")
        for field in ("max_tokens", "top_k", *counts):
            _check_int(field, getattr(self, field))
        for field in ("temperature", "top_p", "min_p"):
            _check_real(field, getattr(self, field))
        for field in ("return_sampling_mask", "prompt_logprobs", "return_routed_experts"):
            if not isinstance(getattr(self, field), bool):
                fail(field, f"expected a bool, got {getattr(self, field)!r}")
        if self.max_tokens < 1:
            fail("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            fail("temperature", f"must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            fail("min_p", f"must be in [0, 1), got {self.min_p}")
        for field in counts:
            if getattr(self, field) < 0:
                fail(field, f"must be >= 0, got {getattr(self, field)}")
        if self.seed is not None:
            object.__setattr__(self, "seed", check_seed(self.seed, "sampling_params.seed"))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        if isinstance(self.stop, str) or not isinstance(self.stop, Sequence):
            fail("stop", f"expected a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "stop strings must be non-empty strings")
        if self.prompt_target_ids is not None:
            _check_target_ids(self.prompt_target_ids)

    @property
    def truncates(self) -> bool:
        """True when the kept set can be smaller than the vocabulary (replay is needed)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0)


@dataclass(frozen=True)
class Draw:
    token: int
    logprob: float  # under the renormalised distribution actually sampled from
    kept: torch.Tensor | None  # int64 sorted ids of the kept set, when asked
    top: tuple[tuple[int, float], ...] = ()  # (id, log-prob) of the most likely kept ids


def kept_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """fp32 log-probs ``[B, V]`` over each row's kept set (``-inf`` elsewhere).

    Row-wise throughout (temperature, then top-k, then top-p over the renormalised top-k
    distribution, then min-p against the row's max), so a row's result never depends on the
    other rows of the batch. Ties at the top-k boundary are broken by vocabulary order."""
    z = logits.to(torch.float32, copy=True)
    rows, vocab = z.shape
    if _untruncated(params):  # every row samples its whole distribution: nothing to mask
        if any(p.temperature != 1.0 for p in params):
            z /= torch.tensor([[p.temperature] for p in params], dtype=torch.float32)
        return torch.log_softmax(z, dim=-1)
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    greedy = temps == 0
    z /= torch.where(greedy, 1.0, temps).unsqueeze(-1)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    keep = torch.ones(rows, vocab, dtype=torch.bool)
    if bool((top_k < vocab).any() or (top_p < 1).any()):
        sorted_z, order = torch.sort(z, dim=-1, descending=True, stable=True)
        ranks = torch.arange(vocab).expand(rows, vocab)
        in_k = ranks < top_k.unsqueeze(-1)
        sorted_p = torch.softmax(sorted_z.masked_fill(~in_k, float("-inf")), dim=-1)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        in_p = (mass_before < top_p.unsqueeze(-1)) | (ranks == 0)  # smallest prefix >= top_p
        keep = torch.zeros_like(keep).scatter_(1, order, in_k & in_p)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    if bool((min_p > 0).any()):
        logp = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
        floor = logp.amax(-1, keepdim=True) + torch.log(min_p).unsqueeze(-1)
        keep &= logp >= floor
    if bool(greedy.any()):
        argmax = torch.zeros_like(keep).scatter_(1, z.argmax(-1, keepdim=True), True)
        keep = torch.where(greedy.unsqueeze(-1), argmax, keep)
    if bool(keep.all()):  # nothing truncated: skip the masking pass
        return torch.log_softmax(z, dim=-1)
    return torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)


def draw_batch(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> list[Draw]:
    """One token per row, each row drawn by inverse CDF with its own request's generator."""
    logp = kept_logprobs(logits, params)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    cdf = torch.cumsum(logp.exp().double(), dim=-1)
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    tokens = tokens.clamp_(max=logp.shape[1] - 1)
    if not _untruncated(params):
        # u can land on a zero-width step at the end: take the last kept id at or before it
        # (with nothing masked every id is kept, so the clamp above is that id)
        index = torch.arange(logp.shape[1])
        eligible = torch.isfinite(logp) & (index <= tokens.unsqueeze(-1))
        tokens = torch.where(eligible, index, -1).amax(-1)
    chosen = logp.gather(1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
    draws = []
    for row, (p, token) in enumerate(zip(params, tokens.tolist(), strict=True)):
        kept = torch.isfinite(logp[row]).nonzero().squeeze(-1) if p.return_sampling_mask else None
        top: tuple[tuple[int, float], ...] = ()
        if p.top_logprobs:
            values, ids = torch.topk(logp[row], min(p.top_logprobs, logp.shape[1]))
            top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        draws.append(Draw(token, chosen[row], kept, top))
    return draws


def _untruncated(params: Sequence[SamplingParams]) -> bool:
    """Every row samples (temperature > 0) from its whole vocabulary (no top-k, top-p, min-p)."""
    return all(p.temperature > 0 and not p.truncates for p in params)


def kept_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row of :func:`kept_logprobs`: ``[V]`` -> ``[V]``."""
    return kept_logprobs(logits.unsqueeze(0), [params])[0]


def draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> Draw:
    """Sample one token from ``logits`` ``[V]`` with the request's own generator."""
    return draw_batch(logits.unsqueeze(0), [params], [generator])[0]


def request_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return g
