"""Log-probs and entropy from full logits ``[R, V]``, chunked like the trainer's path: the
reference the log-prob tests and ``benchmarks/logprobs_memory.py`` (its ``chunked-logits``
variant) measure ``furlong.train.logprobs.head_logprobs`` against. The trainer never holds full
logits, so these live here rather than in the package.

They run the package's own chunking, upcast and kernels (``upcast``, ``log_softmax_gather``,
``entropy_kernel``), looked up on the module at call time so that a test may spy on them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import furlong.train.logprobs as L

DEFAULT_CHUNK_SIZE = L.DEFAULT_CHUNK_SIZE


def _entropy_chunk(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return L.entropy_kernel(L.upcast(logits, temperature))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, **options: Any) -> torch.Tensor:
    """fp32 log-probs of ``targets`` (``[R]`` or ``[R, K]``) under ``logits`` ``[R, V]``:
    ``head_logprobs`` with the identity as the head, so each chunk of rows is upcast, scaled
    and recomputed in backward exactly as there. ``options``: ``temperature``,
    ``chunk_size``, ``recompute``."""
    return L.head_logprobs(logits, nn.Identity(), targets, **options)[0]


def token_entropy(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    recompute: bool = True,
    grad: bool = False,
) -> torch.Tensor:
    """fp32 entropy ``[R]`` of each row. With ``grad=False`` it is a metric: no graph is built."""
    source = logits if grad else logits.detach()
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        parts = [
            L._maybe_checkpoint(_entropy_chunk, source[s], temperature, recompute=recompute)
            for s in L.chunk_slices(logits.shape[0], chunk_size)
        ]
    return torch.cat(parts)


def shard_masked_stats(z_shard: torch.Tensor, keep_shard: torch.Tensor) -> torch.Tensor:
    """One vocabulary shard's masked ``logsumexp`` per row (``-inf`` if no kept id lives there).

    Shards combine with ``torch.logsumexp(torch.stack(stats), 0)`` (an all-reduce of max and
    sum-exp under tensor parallelism)."""
    return torch.logsumexp(z_shard.masked_fill(~keep_shard, float("-inf")), dim=-1)
