"""Sampling parameters and the per-position sampling step of the rollout engine.

The step turns one row of fp32 logits into a token, the log-prob of that token under the
distribution actually sampled from (after temperature, top-k, top-p and min-p, renormalised
over the kept set), and optionally the kept set itself, the thing the trainer replays.
Each request draws from its own seeded generator with inverse-CDF sampling, so a request's
tokens do not depend on which other requests share its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from furlong.errors import InputError


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

    def __post_init__(self) -> None:
        def fail(field: str, why: str) -> None:
            raise InputError(f"sampling_params.{field}: {why}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            fail("max_tokens", f"expected an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            fail("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            fail("temperature", f"must be finite and >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            fail("top_k", f"expected an integer, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            fail("min_p", f"must be in [0, 1), got {self.min_p}")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "stop strings must be non-empty strings")

    @property
    def truncates(self) -> bool:
        """True when the kept set can be smaller than the vocabulary (replay is needed)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0)


@dataclass(frozen=True)
class Draw:
    token: int
    logprob: float  # under the renormalised distribution actually sampled from
    kept: torch.Tensor | None  # int64 sorted ids of the kept set, when asked


def kept_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 log-probs ``[V]`` over the kept set (``-inf`` elsewhere) for one position."""
    z = logits.to(torch.float32, copy=True)
    if params.temperature == 0:  # greedy: the kept set is the argmax alone
        out = torch.full_like(z, float("-inf"))
        out[int(z.argmax())] = 0.0
        return out
    if params.temperature != 1.0:
        z /= params.temperature
    if 0 < params.top_k < z.numel():
        threshold = torch.topk(z, params.top_k).values[-1]
        z[z < threshold] = float("-inf")
    logp = torch.log_softmax(z, dim=-1)
    if params.top_p < 1.0:
        sorted_logp, order = torch.sort(logp, descending=True)
        before = torch.cumsum(sorted_logp.exp(), 0) - sorted_logp.exp()  # mass ahead of each
        drop = before >= params.top_p  # keep the smallest prefix reaching top_p (>= 1 token)
        drop[0] = False
        logp[order[drop]] = float("-inf")
    if params.min_p > 0:
        logp[logp < logp.max() + math.log(params.min_p)] = float("-inf")
    return torch.log_softmax(logp, dim=-1)  # renormalise over the kept set


def draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> Draw:
    """Sample one token from ``logits`` ``[V]`` with the request's own generator."""
    logp = kept_distribution(logits, params)
    probs = logp.exp()
    u = torch.rand((), generator=generator, dtype=torch.float64)
    cdf = torch.cumsum(probs.double(), 0)
    token = int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=probs.numel() - 1))
    while not math.isfinite(float(logp[token])):  # u landed on a zero-width step at the end
        token -= 1
    kept = torch.isfinite(logp).nonzero().squeeze(-1) if params.return_sampling_mask else None
    return Draw(token=token, logprob=float(logp[token]), kept=kept)


def request_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return g
