"""Model FLOPs of a dense Llama-style decoder (Qwen3, Qwen2, Llama), and the machine's measured
GEMM peak to compare them with: the two halves of a model-FLOPs utilisation (MFU).

Model FLOPs count what the model needs, not what an implementation runs (a recomputed
forward is not counted): a multiply-add is 2 FLOPs; a linear ``[in, out]`` over T tokens is
``2 in out T`` forward, as much again for the gradient of its input, and as much again for its
weight's gradient when the weight trains. Causal attention over a context of ``c`` positions
costs ``4 heads head_dim c`` per query forward (scores and values), twice that backward.
Embedding lookups, norms and activations are left out (no GEMM work).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> Shape:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            config.num_hidden_layers,
            config.hidden_size,
            heads,
            config.num_key_value_heads,
            head_dim,
            config.intermediate_size,
            config.vocab_size,
        )

    def linears(self) -> list[tuple[int, int]]:
        """Every GEMM weight ``(in, out)``: the layers' projections, then the LM head."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        layer = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
        return layer * self.layers + [(h, self.vocab)]


def attention_flops(shape: Shape, lengths: list[int], new: int | None = None) -> float:
    """Forward score and value products of causal attention: each of a sequence's last ``new``
    queries (all of them by default) attends to every position up to its own."""
    total = 0
    for n in lengths:
        first = n - (new if new is not None else n)
        total += sum(p + 1 for p in range(first, n))  # context of each query
    return 4.0 * shape.layers * shape.heads * shape.head_dim * total


def train_flops(shape: Shape, lengths: list[int], lora_rank: int | None = None) -> float:
    """One forward and backward over sequences of ``lengths``: full fine-tuning, or a LoRA
    adapter of ``lora_rank`` on every linear (frozen base and embedding: no base weight
    gradient, no gradient into the embedding)."""
    tokens = sum(lengths)
    weights = sum(a * b for a, b in shape.linears())
    per_pass = 2.0 * weights * tokens
    if lora_rank is None:
        dense = 3 * per_pass
    else:
        adapter = sum(lora_rank * (a + b) for a, b in shape.linears())
        dense = 2 * per_pass + 3 * 2.0 * adapter * tokens
        # the embedding is frozen: nothing needs the gradient of the first layer's input, so
        # its q, k and v projections (base and adapter A) have none
        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        dense -= 2.0 * tokens * shape.hidden * (q + 2 * kv + 3 * lora_rank)
    return dense + 3 * attention_flops(shape, lengths)


def decode_flops(shape: Shape, prompt: int, new: int, batch: int = 1) -> float:
    """Generating ``new`` tokens after a ``prompt`` for ``batch`` sequences, forward only: the
    decoder over every position (prefill and decode steps), the LM head only where a token is
    sampled (the last prompt position, then each new one but the last: ``new`` rows)."""
    *layers, (hidden, vocab) = shape.linears()
    body = sum(a * b for a, b in layers)
    per_sequence = 2.0 * (body * (prompt + new - 1) + hidden * vocab * new)
    return batch * per_sequence + attention_flops(shape, [prompt + new - 1] * batch)


def gemm_peak(dtype: torch.dtype = torch.float32, size: int = 1024, seconds: float = 1.0) -> float:
    """GFLOP/s of the best square ``size`` matmul in ``dtype`` on this process's threads."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: packing buffers, thread pool
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best / 1e9
