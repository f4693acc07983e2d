"""The embedded engine's model runner: the forward passes of an HF causal LM, and its weights.

The scheduler (:class:`~furlong.rollout.engine.EmbeddedEngine`) decides which requests run at
each step; the runner runs them. A step is one left-padded prefill for the requests joining
it (with the prompt log-probs they ask for, and each distinct sequence once when several join
with the same one) and one decode pass for the running batch; both append the routed-expert
rows of the requests that ask for them (MoE routing replay). The runner also owns the weights:
their names and shapes, publication, and offload to host memory and back.

The caller holds :attr:`ModelRunner.lock` and inference mode around the passes of a step, so
a publication or an offload never lands between two passes of one step. Queues, threads,
futures and pausing are the scheduler's; the runner reads and writes only the parts of a
request named by :class:`SequenceState`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel

from furlong.errors import InputError
from furlong.models.fast_forward import FastForward
from furlong.rollout import kv_cache
from furlong.rollout.base import MemoryBytes, MemoryTag, Weights, check_weight_shapes
from furlong.rollout.routing import RoutingRecorder
from furlong.rollout.sampling import SamplingParams, csr_tensor

Prefilled = tuple[Any, torch.Tensor, torch.Tensor]  # (cache, [B, T] mask, [B, V] fp32 logits)


class SequenceState(Protocol):
    """What the runner reads (prompt, output so far, params) and writes (prompt scores, routed
    rows) of one request."""

    prompt: list[int]
    output: list[int]
    params: SamplingParams
    prompt_logprobs: list[float] | None
    prompt_top: list[list[tuple[int, float]] | None] | None
    prompt_target: torch.Tensor | None  # log-probs of params.prompt_target_ids
    routing: list[torch.Tensor]  # [positions, layers, top_k] parts


class ModelRunner:
    """Runs the passes of an in-process HF model and changes its weights."""

    def __init__(self, model: PreTrainedModel, fast_forward: bool = True):
        """``fast_forward``: run dense Qwen3/Qwen2/Llama models through :class:`FastForward`
        (same logits, less per-step overhead); other models always use the HF forward."""
        self.model = model.eval()
        self.fast = FastForward(model) if fast_forward and FastForward.supports(model) else None
        self.device = next(model.parameters()).device
        self.router = RoutingRecorder(model)
        self.lock = threading.RLock()  # held while the model runs or its weights change
        self.offloaded: set[MemoryTag] = set()
        self._host_weights: dict[str, torch.Tensor] = {}  # while "weights" is offloaded

    # ---------------------------------------------------------------- passes

    def prefill(self, joining: Sequence[SequenceState]) -> Prefilled:
        """Prefill prompt + output so far (a retracted request recomputes its prefix)."""
        seqs = [r.prompt + r.output for r in joining]
        width = max(map(len, seqs))
        ids, mask = self._left_padded(seqs, width)
        want_prompt = [_wants_prompt(r.params) and r.prompt_logprobs is None for r in joining]
        if not any(want_prompt) and not _wants_routing(joining):
            shared = self._prefill_once(seqs, width)
            if shared is not None:  # GRPO: each group's prompt runs once
                return shared
        cache = kv_cache.new_cache(self.model.config)
        with self.router.record(_wants_routing(joining)):
            positions = (mask.cumsum(1) - 1).clamp(min=0)
            logits = self._forward(ids, mask, positions, cache, 0 if any(want_prompt) else 1)
        # a retracted request keeps the rows it sampled with: only positions past them are new
        first = [width - len(s) + _routed(r) for r, s in zip(joining, seqs, strict=True)]
        self._collect_routing(joining, first)
        for row, request in enumerate(joining):
            if want_prompt[row]:  # first prefill: the sequence is the prompt
                self._score_prompt(request, logits[row, width - len(request.prompt) : -1])
        return cache, mask, logits[:, -1].float()

    def _score_prompt(self, request: SequenceState, logits: torch.Tensor) -> None:
        """The prompt's log-probs, top log-probs and target log-probs, from its ``[n - 1, V]``
        logits (row i predicting prompt position i + 1)."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(request.prompt[1:], device=self.device).unsqueeze(-1)
        picked = logp.gather(-1, target).squeeze(-1)
        request.prompt_logprobs = [float("nan")] + picked.tolist()
        if k := min(request.params.prompt_top_logprobs, logp.shape[-1]):
            values, ids = logp.topk(k, dim=-1)
            rows = [
                list(zip(i, v, strict=True))
                for i, v in zip(ids.tolist(), values.tolist(), strict=True)
            ]
            request.prompt_top = [None, *rows]
        if (targets := request.params.prompt_target_ids) is not None:
            request.prompt_target = _target_logprobs(logp, targets)

    def _prefill_once(self, seqs: list[list[int]], width: int) -> Prefilled | None:
        """Prefill each distinct sequence once and copy its cache rows and logits to every
        request that joins with it; None when all are distinct."""
        distinct: dict[tuple[int, ...], int] = {}
        owner = [distinct.setdefault(tuple(s), len(distinct)) for s in seqs]
        if len(distinct) == len(seqs):
            return None
        ids, mask = self._left_padded([list(s) for s in distinct], width)
        cache = kv_cache.new_cache(self.model.config)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits = self._forward(ids, mask, positions, cache, 1)
        index = torch.tensor(owner, device=self.device)
        cache, mask = kv_cache.expand(cache, mask, index)
        return cache, mask, logits[index, -1].float()

    def _left_padded(self, seqs: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and attention mask ``[len(seqs), width]``, each sequence left-padded."""
        ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs], device=self.device)
        mask = torch.tensor(
            [[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=self.device
        )
        return ids, mask

    def decode(
        self, cache: Any, mask: torch.Tensor, last: list[int], running: Sequence[SequenceState]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each running row its newest token; returns the next logits ``[B, V]`` (fp32)
        and the mask grown by one position."""
        mask = torch.cat([mask, mask.new_ones(len(last), 1)], dim=1)
        ids = torch.tensor(last, device=self.device).unsqueeze(1)
        with self.router.record(_wants_routing(running)):
            logits = self._forward(ids, mask, mask.sum(1, keepdim=True) - 1, cache, 1)
        self._collect_routing(running, [0] * len(running))
        return logits[:, -1].float(), mask

    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        logits_to_keep: int,
    ) -> torch.Tensor:
        if self.fast is not None:
            return self.fast(ids, mask, positions, cache, logits_to_keep)
        return self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        ).logits

    # ---------------------------------------------------------------- routed experts

    def _collect_routing(self, requests: Sequence[SequenceState], first: list[int]) -> None:
        """Append each asking request's routed-expert rows of the last forward pass, from its
        row ``first`` on (past the left padding, and past rows it already holds)."""
        if not _wants_routing(requests):
            return
        rows = self.router.rows(len(requests))  # [batch, positions, layers, top_k]
        for row, (request, start) in enumerate(zip(requests, first, strict=True)):
            if request.params.return_routed_experts:
                request.routing.append(rows[row, start:].cpu())

    def routed_experts(self, request: SequenceState) -> torch.Tensor:
        """The request's routed-expert rows ``[positions, layers, top_k]`` (int32) from
        ``params.routed_experts_start`` on, for its result."""
        # an aborted request has also fed its last token; rows stop before it
        end = len(request.prompt) + len(request.output) - 1
        rows = torch.cat(request.routing)[:end] if request.routing else self._no_rows()
        return rows[request.params.routed_experts_start :].to(torch.int32, copy=True)

    def _no_rows(self) -> torch.Tensor:
        top_k = getattr(self.model.config, "num_experts_per_tok", 0)
        return torch.empty(0, len(self.router.routers), top_k, dtype=torch.int32)

    # ---------------------------------------------------------------- weights

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each publishable tensor's name and shape."""
        return {name: tuple(t.shape) for name, t in self._weight_targets().items()}

    def check_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Raise :class:`InputError` unless every tensor names one of the model's parameters
        with its shape."""
        check_weight_shapes(weights, self.weight_shapes())

    @torch.no_grad()
    def update_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Check every name and shape, then copy (into the host copy while offloaded)."""
        with self.lock:
            self.check_weights(weights)
            targets = self._weight_targets()
            for name, tensor in weights.items():
                targets[name].copy_(tensor)

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        if "weights" in self.offloaded:
            return self._host_weights
        # detach(), not .data: it shares the parameter's version counter, so the copy bumps it
        # and FastForward's packed inference weights see the change
        return {name: p.detach() for name, p in self.model.named_parameters()}

    # ---------------------------------------------------------------- memory

    def offload(self, tags: Collection[MemoryTag], cache: Any) -> None:
        """Move ``tags`` (none offloaded already) to host memory: ``kv_cache`` is ``cache``, the
        batch's (if any); ``weights`` are the parameters (on CPU they are detached)."""
        with self.lock:
            if "kv_cache" in tags and cache is not None:
                kv_cache.move(cache, "cpu")
            if "weights" in tags:
                for name, p in self.model.named_parameters():
                    self._host_weights[name] = p.data.to("cpu")
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                if self.fast is not None:  # rebuilt from the weights at the next pass
                    self.fast.packed.clear()
            self.offloaded.update(tags)
        _release_device_cache(self.device)

    def onload(self, tags: Collection[MemoryTag], cache: Any) -> None:
        """Bring back exactly what :meth:`offload` released (``tags`` are all offloaded)."""
        with self.lock:
            if "weights" in tags:
                for name, p in self.model.named_parameters():
                    p.data = self._host_weights.pop(name).to(self.device)
            if "kv_cache" in tags and cache is not None:
                kv_cache.move(cache, self.device)
            self.offloaded.difference_update(tags)

    def memory_bytes(self, cache: Any) -> MemoryBytes:
        """What the weights (with FastForward's packed copy), ``cache`` (the batch's, None
        when empty) and the host copy of offloaded weights hold."""
        live = cache is not None and "kv_cache" not in self.offloaded
        packed = 0 if self.fast is None else self.fast.packed.nbytes
        return {
            "weights": sum(p.data.nbytes for p in self.model.parameters()) + packed,
            "kv_cache": kv_cache.nbytes(cache) if live else 0,
            "mirror": sum(t.nbytes for t in self._host_weights.values()),
        }


def read_weights(weights: Weights) -> Mapping[str, torch.Tensor]:
    """A state dict as is, or the tensors of a safetensors file / every one in a directory."""
    if not isinstance(weights, str | os.PathLike):
        return weights
    path = Path(weights)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise InputError(f"update_weights: no safetensors file at {path}")
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def keep_sampled_routes(request: SequenceState) -> None:
    """On a retract, keep the rows of every position whose logits were sampled from (the
    prompt and every output token but the last); the last token's logits are discarded and
    recomputed with the prefix, so its row is too. Replaying a recomputed row (routing under
    the new weights) for a token sampled under the old routing is the bug R3 exists to avoid."""
    if request.routing:
        used = len(request.prompt) + len(request.output) - 1
        request.routing = [torch.cat(request.routing)[:used]]


def _routed(request: SequenceState) -> int:
    """Positions whose routed-expert rows the request has recorded so far."""
    return sum(int(rows.shape[0]) for rows in request.routing)


def _wants_routing(requests: Sequence[SequenceState]) -> bool:
    return any(r.params.return_routed_experts for r in requests)


def _wants_prompt(params: SamplingParams) -> bool:
    return (
        params.prompt_logprobs
        or params.prompt_top_logprobs > 0
        or params.prompt_target_ids is not None
    )


def _target_logprobs(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``logp`` ``[n - 1, V]`` (the prompt rows' full-vocabulary log-softmax, row i predicting
    position i + 1) at the ids of ``ids``, in ``ids``' shape and layout (dense or sparse CSR,
    on the CPU); NaN where an id is -1, which asks for nothing."""
    if ids.layout == torch.sparse_csr:
        crow, col, values = ids.crow_indices(), ids.col_indices(), ids.values()
        rows = torch.repeat_interleave(torch.arange(ids.shape[0], device=crow.device), crow.diff())
        cols = values.to(logp.device)
        picked = logp[rows.to(logp.device), cols.clamp(min=0)]
        picked = picked.masked_fill(cols < 0, float("nan")).cpu()
        crow, col = crow.to("cpu", copy=True), col.to("cpu", copy=True)
        return csr_tensor(crow, col, picked, (ids.shape[0], ids.shape[1]))
    cols = ids.to(logp.device)
    picked = logp.gather(-1, cols.clamp(min=0))
    return picked.masked_fill(cols < 0, float("nan")).cpu()


def _release_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
