"""Target log-probs and entropy from hidden states, in chunks of rows, with a delayed FP32
upcast: ``head_logprobs``, the one log-prob path of the trainer.

The LM head runs per chunk of rows, so the full ``[T, V]`` logits never exist, in forward or
in backward. Each chunk's logits are model precision, *copied* to fp32 (never aliased, so
in-place kernels cannot touch the model output), divided by the temperature in fp32, then
log-softmaxed. Under autograd with ``recompute`` (the default) every chunk is recomputed in
backward (a fused path for a plain ``nn.Linear`` head, a non-reentrant checkpoint otherwise),
so neither the transient peak nor the saved-for-backward memory grows with the number of rows.

Also here: sampling-mask replay (``RowSupports``: masked rows renormalised over their kept
set; ``check_targets_in_support``; ``masked_token_logprobs`` for logits already in hand) and
the kernels and chunking the path is built from. The logits-given reference that the tests
and ``benchmarks/logprobs_memory.py`` compare against is ``tests/train/logprob_reference.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from furlong.csr import row_contains, row_of
from furlong.errors import InputError
from furlong.models.fast_forward import lora_terms, runs_as_linear

DEFAULT_CHUNK_SIZE = 256
CHUNK_BYTES = 128 * 2**20  # fp32 working set per chunk when the chunk size is chosen for you
T = TypeVar("T")
EntropyMode = Literal["none", "metric", "grad"]


def chunk_slices(rows: int, chunk_size: int) -> list[slice]:
    """``ceil(rows / chunk_size)`` nearly equal row ranges, each at most ``chunk_size`` rows.

    ``chunk_size <= 0`` means one chunk. Zero rows give one empty range so callers still get
    correctly typed empty outputs.
    """
    if rows == 0 or chunk_size <= 0:
        return [slice(0, rows)]
    n = math.ceil(rows / chunk_size)
    base, extra = divmod(rows, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        bounds.append(slice(start, stop))
        start = stop
    return bounds


def auto_chunk_size(vocab_size: int) -> int:
    """Rows per chunk so one fp32 chunk ``[C, V]`` takes about ``CHUNK_BYTES``."""
    return max(64, CHUNK_BYTES // (4 * max(1, vocab_size)))


def _scales(temperature: float) -> bool:
    """Whether ``temperature`` changes the logits (0 and 1 leave them as they are)."""
    return temperature > 0 and temperature != 1.0


def upcast(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """An fp32 *copy* of ``logits``, divided by ``temperature`` after the upcast."""
    z = logits.to(torch.float32, copy=True)
    if _scales(temperature):
        z = z / temperature
    return z


def log_softmax_gather(z_fp32: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Kernel: fp32 rows ``[C, V]`` and targets ``[C]`` or ``[C, K]`` -> their log-probs."""
    logp = torch.log_softmax(z_fp32, dim=-1)
    if targets.dim() == 1:
        return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp.gather(-1, targets)


def entropy_kernel(z_fp32: torch.Tensor) -> torch.Tensor:
    """Kernel: fp32 rows ``[C, V]`` -> entropy of each row's softmax ``[C]``."""
    logp = torch.log_softmax(z_fp32, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def graph_connected_zero(logits: torch.Tensor) -> torch.Tensor:
    """An fp32 zero that keeps ``logits`` in the graph (backward and its collectives still run).

    Summing in fp32 matters: a half-precision sum of large logits overflows to inf and
    ``0 * inf`` is NaN.
    """
    return logits.sum(dtype=torch.float32) * 0.0


def _maybe_checkpoint(fn: Callable[..., T], *args: object, recompute: bool) -> T:
    # Parameters captured by ``fn`` (the LM head) may need grad even when the inputs do not.
    if recompute and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def _gather(z: torch.Tensor, targets: torch.Tensor, supports: RowSupports | None) -> torch.Tensor:
    if supports is None:
        return log_softmax_gather(z, targets)
    return masked_log_softmax_gather(z, targets, supports.keep(z.shape[-1]))


def support_matrix(
    vocab_size: int, ids: torch.Tensor, offsets: torch.Tensor, vocab_start: int = 0
) -> torch.Tensor:
    """Bool ``[rows, vocab_size]`` from CSR supports (``ids`` int, ``offsets`` ``[rows + 1]``).

    ``vocab_start`` selects a vocabulary shard ``[vocab_start, vocab_start + vocab_size)``;
    ids outside it are dropped."""
    local = ids.to(torch.int64) - vocab_start
    inside = (local >= 0) & (local < vocab_size)
    keep = torch.zeros(offsets.numel() - 1, vocab_size, dtype=torch.bool, device=ids.device)
    keep[row_of(offsets)[inside], local[inside]] = True
    return keep


def masked_log_softmax_gather(
    z_fp32: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """Kernel: ``z[a] - logsumexp_{S}(z)``; tokens outside the support get no gradient and a
    singleton support gives exactly 0. Masking commutes with the temperature division."""
    masked = z_fp32.masked_fill(~keep, float("-inf"))
    return torch.log_softmax(masked, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True)
class RowSupports:
    """Kept sets for some rows: ``masked`` ``[R]`` bool; CSR ``ids`` / ``offsets`` ``[R + 1]``
    where unmasked rows have length 0 (full vocabulary)."""

    masked: torch.Tensor
    ids: torch.Tensor
    offsets: torch.Tensor

    def chunk(self, s: slice) -> RowSupports:
        lo, hi = int(self.offsets[s.start]), int(self.offsets[s.stop])
        return RowSupports(self.masked[s], self.ids[lo:hi], self.offsets[s.start : s.stop + 1] - lo)

    def keep(self, vocab_size: int) -> torch.Tensor:
        keep = support_matrix(vocab_size, self.ids, self.offsets)
        return keep | ~self.masked.unsqueeze(-1)


def check_targets_in_support(
    targets: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor
) -> None:
    """Every sampled token must lie in its own row's kept set (CSR, no ``[R, V]`` matrix)."""
    inside = row_contains(ids, offsets, targets)
    if not bool(inside.all()):
        row = int((~inside).nonzero()[0])
        raise InputError(
            f"sampling mask: position {row}: target token {int(targets[row])} is not in its "
            "kept-token set"
        )


def masked_token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    recompute: bool = True,
) -> torch.Tensor:
    """Sampling-mask replay over logits you already hold (docs/rollout.md): fp32 log-probs of
    ``targets`` ``[R]`` under ``logits`` ``[R, V]``, renormalised over each row's kept set
    (CSR ``ids`` / ``offsets`` ``[R + 1]``). :func:`head_logprobs` with the identity as the
    head, so chunked and recomputed the same way.

    Raises InputError when a target lies outside its row's support."""
    if offsets.numel() != logits.shape[0] + 1:
        raise InputError(
            f"sampling mask: {offsets.numel() - 1} positions for {logits.shape[0]} rows"
        )
    check_targets_in_support(targets, ids, offsets)
    every_row = RowSupports(torch.ones(logits.shape[0], dtype=torch.bool), ids, offsets)
    lp, _ = head_logprobs(
        logits,
        nn.Identity(),
        targets,
        temperature=temperature,
        chunk_size=chunk_size,
        recompute=recompute,
        supports=every_row,
    )
    return lp


def _head_chunk(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    entropy: EntropyMode,
    supports: RowSupports | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    z = upcast(head(hidden), temperature)
    logprobs = _gather(z, targets, supports)
    if entropy == "grad":  # the entropy is always the full-vocabulary one
        return logprobs, entropy_kernel(z)
    if entropy == "metric":
        with torch.no_grad():
            return logprobs, entropy_kernel(z.detach())
    return logprobs, z.new_empty(0)


def head_logprobs(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    recompute: bool = True,
    entropy: EntropyMode = "none",
    supports: RowSupports | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally entropy) with the LM head applied per chunk of rows.

    ``supports`` replays sampling masks: masked rows are renormalised over their kept set
    (entropy stays the full-vocabulary metric).

    ``hidden`` is ``[R, H]``; ``head`` maps ``[C, H]`` to model-precision logits ``[C, V]``.
    The full logits never exist; with ``recompute`` each chunk's head is re-run in backward.
    A plain ``nn.Linear`` head, or a vanilla peft LoRA layer over one with one active adapter,
    takes a fused path whose backward sums the weight gradient into one buffer (no ``[V, H]``
    temporary per chunk; a low-precision head split into several chunks sums in fp32 through
    one reused product buffer); other heads and a differentiable entropy take the generic
    checkpointed path.
    """
    if supports is not None and targets.dim() != 1:
        raise InputError("sampling masks: replay needs 1-D target_tokens")
    parts = _linear_parts(head) if supports is None and recompute and entropy != "grad" else None
    if parts is not None:
        base, adapter = parts
        lora_u, lora_b, scale = None, None, 1.0
        if adapter is not None:
            lora_a, lora_b, scale = adapter
            lora_u = torch.mm(hidden, lora_a.t())  # [R, r]: autograd takes A's gradient here
        lp, ent = _LinearHeadLogprobs.apply(
            hidden,
            base.weight,
            base.bias,
            lora_u,
            lora_b,
            scale,
            targets,
            temperature,
            chunk_size,
            entropy == "metric",
        )
        return lp, (ent if entropy == "metric" else None)
    lps, ents = [], []
    for s in chunk_slices(hidden.shape[0], chunk_size):
        lp, ent = _maybe_checkpoint(
            _head_chunk,
            hidden[s],
            targets[s],
            head,
            temperature,
            entropy,
            None if supports is None else supports.chunk(s),
            recompute=recompute,
        )
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), (torch.cat(ents) if entropy != "none" else None)


# a LoRA head's adapter term for some rows: (hidden @ A.T, B, scaling), added as s * u @ B.T
LowRank = tuple[torch.Tensor, torch.Tensor, float]


def _linear_parts(
    head: Any,
) -> tuple[nn.Linear, tuple[torch.Tensor, torch.Tensor, float] | None] | None:
    """The fused path's view of ``head``: its base linear and, for a peft LoRA layer with one
    active adapter in the base's dtype, that adapter's (A, B, scaling); None for any other head
    (e.g. fp32 adapters on a bf16 base, which peft adds in fp32 and rounds)."""
    if type(head) is nn.Linear:
        return head, None
    if not runs_as_linear(head):
        return None
    terms = lora_terms(head)
    if len(terms) > 1 or any(a.dtype != head.base_layer.weight.dtype for a, _, _ in terms):
        return None
    return head.base_layer, (terms[0] if terms else None)


def _rows(
    lora_u: torch.Tensor | None, lora_b: torch.Tensor | None, scale: float, s: slice
) -> LowRank | None:
    """The adapter term of the fused head for the rows ``s`` (None without an adapter)."""
    return None if lora_u is None or lora_b is None else (lora_u[s], lora_b, scale)


class _ChunkWorkspace:
    """One ``[C, V]`` logits buffer (plus an fp32 one for low-precision models) reused by every
    chunk: a fresh buffer per chunk costs page faults on each allocation, and one buffer
    instead of a logits + temporary pair halves the transient peak."""

    def __init__(self, rows: int, weight: torch.Tensor):
        vocab = weight.shape[0]
        self.logits = weight.new_empty(rows, vocab)
        fp32 = weight.dtype == torch.float32
        self.fp32 = self.logits if fp32 else weight.new_empty(rows, vocab, dtype=torch.float32)

    def fp32_logits(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        temp: float,
        low: LowRank | None = None,
    ) -> torch.Tensor:
        """``upcast(hidden @ W.T + b [+ s * u @ B.T]) / temp`` in the workspace: the buffer is
        private, so the defensive copy of :func:`upcast` is not needed."""
        out = self.logits[: hidden.shape[0]]
        if bias is None:
            logits = torch.mm(hidden, weight.t(), out=out)
        else:
            logits = torch.addmm(bias, hidden, weight.t(), out=out)
        if low is not None:  # peft's order: the adapter's product, scaled, added to the base's
            u, lora_b, scale = low
            logits.addmm_(u, lora_b.t(), alpha=scale)
        z = logits if self.fp32 is self.logits else self.fp32[: len(out)].copy_(logits)
        if _scales(temp):
            z.div_(temp)
        return z

    def in_model_dtype(self, z: torch.Tensor) -> torch.Tensor:
        return z if self.fp32 is self.logits else self.logits[: len(z)].copy_(z)


class _LinearHeadLogprobs(torch.autograd.Function):
    """Chunked ``log_softmax(upcast(hidden @ W.T + b [+ s * u @ B.T]) / T)[target]`` with
    per-chunk recompute; ``u = hidden @ A.T`` and ``B`` are a LoRA head's adapter (its A's
    gradient flows back through ``u``), so a LoRA head is fused too.

    Saves only ``hidden``, the head's parameters, the targets and one fp32 log-sum-exp per row.
    Backward recomputes each chunk's logits into a reused buffer and turns it into the logits
    gradient in place: ``g * (onehot - softmax) / T``. Every reduction is row-wise, so a row's
    result does not depend on which rows share its chunk.
    """

    @staticmethod
    def forward(
        ctx: Any,  # torch's context object: it also holds our fields (temperature, chunk_size)
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora_u: torch.Tensor | None,
        lora_b: torch.Tensor | None,
        lora_scale: float,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        want_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        slices = chunk_slices(hidden.shape[0], chunk_size)
        work = _ChunkWorkspace(slices[0].stop - slices[0].start, weight)
        # One chunk: its softmax is kept for backward (the chunk's budget, already allocated),
        # which then skips a head GEMM and the exp; several chunks are recomputed one by one.
        keep = len(slices) == 1 and any(ctx.needs_input_grad[:5])
        lps, lses, ents, probs = [], [], [], None
        for s in slices:
            low = _rows(lora_u, lora_b, lora_scale, s)
            z = work.fp32_logits(hidden[s], weight, bias, temperature, low)
            t = targets[s] if targets.dim() == 2 else targets[s].unsqueeze(-1)
            picked = z.gather(-1, t)
            if want_entropy:
                ents.append(entropy_kernel(z))
            peak = z.amax(dim=-1, keepdim=True)
            e = z.sub_(peak).exp_()  # z is spent now
            total = e.sum(-1, keepdim=True)
            lse = total.log() + peak
            lps.append((picked - lse).reshape(targets[s].shape))
            lses.append(lse.squeeze(-1))
            if keep:
                probs = e.div_(total)
        ctx.save_for_backward(hidden, weight, bias, lora_u, lora_b, targets, torch.cat(lses))
        ctx.temperature, ctx.chunk_size, ctx.lora_scale = temperature, chunk_size, lora_scale
        ctx.kept = probs  # not saved_tensors: backward spends it in place, once
        entropy = torch.cat(ents) if want_entropy else hidden.new_empty(0, dtype=torch.float32)
        ctx.mark_non_differentiable(entropy)
        return torch.cat(lps), entropy

    @staticmethod
    def backward(
        ctx: Any, grad_lp: torch.Tensor, _grad_entropy: object
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, lora_u, lora_b, targets, lse = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, None  # a retain_graph rerun recomputes
        temperature, scale = ctx.temperature, ctx.lora_scale
        need_h, need_w, need_b, need_u, need_lb = ctx.needs_input_grad[:5]
        slices = chunk_slices(hidden.shape[0], ctx.chunk_size)
        # A low-precision head summed over several chunks keeps its parameter gradients in fp32
        # and rounds once at the end: rounding the running sum after every chunk makes the error
        # grow with the number of chunks. fp32 heads and single chunks sum in place as before.
        acc = torch.float32 if len(slices) > 1 else weight.dtype
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=acc) if (need_b and bias is not None) else None
        grad_u = torch.empty_like(lora_u) if need_u else None
        grad_lb = torch.zeros_like(lora_b, dtype=acc) if need_lb else None
        # each chunk's product still runs as a model-precision GEMM (fp32 inside), into this
        part = torch.empty_like(weight) if need_w and acc != weight.dtype else None
        work = _ChunkWorkspace(slices[0].stop - slices[0].start, weight)
        for s in slices:
            if kept is not None:  # turned into the gradient in place
                probs = kept
            else:
                low = _rows(lora_u, lora_b, scale, s)
                z = work.fp32_logits(hidden[s], weight, bias, temperature, low)
                probs = z.sub_(lse[s].unsqueeze(-1)).exp_()  # softmax, in place
            g = grad_lp[s].float()
            t = targets[s] if targets.dim() == 2 else targets[s].unsqueeze(-1)
            g2 = g if g.dim() == 2 else g.unsqueeze(-1)
            probs.mul_(-g2.sum(-1, keepdim=True)).scatter_add_(1, t, g2)
            if _scales(temperature):
                probs.div_(temperature)
            grad_logits = work.in_model_dtype(probs)
            if grad_h is not None:
                torch.mm(grad_logits, weight, out=grad_h[s])
            if grad_w is not None and part is None:
                grad_w.addmm_(grad_logits.t(), hidden[s])
            elif grad_w is not None:
                grad_w.add_(torch.mm(grad_logits.t(), hidden[s], out=part))
            if grad_b is not None:
                grad_b.add_(grad_logits.sum(0, dtype=acc))
            if grad_u is not None:
                torch.mm(grad_logits, lora_b, out=grad_u[s]).mul_(scale)
            if grad_lb is not None:  # [V, r]: small, so a low-precision product is just added
                grad_lb.add_(torch.mm(grad_logits.t(), lora_u[s]), alpha=scale)
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            grad_u,
            None if grad_lb is None else grad_lb.to(lora_b.dtype),
            None,
            None,
            None,
            None,
            None,
        )
