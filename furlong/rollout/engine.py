"""The embedded rollout engine: continuous batching over an HF causal LM with a KV cache.

Requests join the running batch as soon as a slot is free and leave as soon as they stop, so
short answers never wait for long ones. The batch shares one left-padded KV cache: requests
joining at the same step are prefilled together and their cache rows are padded into the
batch; a leaving request is selected out and common left padding is trimmed. Every generated
token comes with its log-prob under the distribution actually sampled from and, on request,
its kept set (a ``SamplingMask``).

Not yet here (rollout issue): pause modes and the memory API.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from furlong.errors import InputError
from furlong.rollout.routing import RoutingRecorder
from furlong.rollout.sampling import Draw, SamplingParams, draw_batch, request_generator
from furlong.rollout.sampling_mask import SamplingMask

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class GenerateResult:
    request_id: int
    prompt_ids: list[int]
    output_ids: list[int]  # the terminating token(s) included
    output_logprobs: list[float]
    finish_reason: FinishReason
    sampling_mask: SamplingMask | None
    weight_version: int
    prompt_logprobs: list[float] | None = None  # raw model log-probs, NaN at position 0
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per output token
    # MoE: int32 [len(prompt + output) - 1 - start, layers, top_k]; row i = position start + i
    routed_experts: torch.Tensor | None = None
    routed_experts_start: int = 0


@dataclass
class _Running:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    kept: list[list[int]] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None
    routing: list[torch.Tensor] = field(default_factory=list)  # [positions, layers, top_k] parts


class EmbeddedEngine:
    """Rollout on an in-process HF model (the CPU default; also the tests' reference)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_running: int = 16):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_running = max_running
        self.weight_version = 0
        self.vocab_size = int(model.get_output_embeddings().out_features)
        eos = model.generation_config.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._ids = itertools.count()
        self.router = RoutingRecorder(model)

    # ---------------------------------------------------------------- API

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerateResult]:
        """Generate for every prompt (results in request order), batching continuously."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise InputError(f"params: {len(plist)} for {len(prompts)} prompts")
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise InputError(f"prompts[{i}]: empty")
            bad = [t for t in prompt if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise InputError(f"prompts[{i}]: token id {bad[0]} outside [0, {self.vocab_size})")
        if any(p.return_routed_experts for p in plist) and not self.router.is_moe:
            raise InputError("return_routed_experts: the model has no MoE routers")
        queue = deque(
            _Running(
                request_id=next(self._ids),
                prompt=[int(t) for t in prompt],
                params=p,
                stop_ids=self.eos_ids if p.stop_token_ids is None else frozenset(p.stop_token_ids),
                generator=request_generator(p.seed),
            )
            for prompt, p in zip(prompts, plist, strict=True)
        )
        order = [r.request_id for r in queue]
        done = {req.request_id: (req, reason) for req, reason in self._run(queue)}
        return [self._result(*done[i]) for i in order]

    @torch.no_grad()
    def update_weights(self, weights: Mapping[str, torch.Tensor] | str | os.PathLike) -> int:
        """Publish new weights (a state dict in process, or a safetensors file / HF directory
        across processes). Every name and shape is checked before any copy; returns the new
        weight version, which every later result carries."""
        if isinstance(weights, str | os.PathLike):
            path = Path(weights)
            files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
            if not files or not all(f.is_file() for f in files):
                raise InputError(f"update_weights: no safetensors file at {path}")
            weights = {k: v for f in files for k, v in load_file(str(f)).items()}
        params = dict(self.model.named_parameters())
        unknown = sorted(set(weights) - set(params))
        if unknown:
            raise InputError(f"update_weights: unknown tensors {unknown[:4]}")
        for name, tensor in weights.items():
            if tensor.shape != params[name].shape:
                raise InputError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                    f"the engine's is {tuple(params[name].shape)}"
                )
        for name, tensor in weights.items():
            params[name].copy_(tensor)
        self.weight_version += 1
        return self.weight_version

    # ---------------------------------------------------------------- scheduler

    @torch.no_grad()
    def _run(self, queue: deque[_Running]):
        running: list[_Running] = []
        cache, mask, logits = None, None, None  # batch state: cache, [B, T] mask, [B, V]
        while queue or running:
            joining = []
            while queue and len(running) + len(joining) < self.max_running:  # join
                joining.append(queue.popleft())
            if joining:  # one left-padded prefill for everyone joining at this step
                new_cache, new_mask, new_logits = self._prefill(joining)
                cache, mask = _merge(cache, mask, new_cache, new_mask)
                logits = new_logits if logits is None else torch.cat([logits, new_logits])
                running.extend(joining)
            draws = draw_batch(logits, [r.params for r in running], [r.generator for r in running])
            keep, last = [], []
            for row, (req, d) in enumerate(zip(running, draws, strict=True)):  # one token each
                reason = self._record(req, d)
                if reason is None:
                    keep.append(row)
                    last.append(req.output[-1])
                else:
                    yield req, reason
            if len(keep) < len(running):  # leave
                running = [running[i] for i in keep]
                if not running:
                    cache, mask, logits = None, None, None
                    continue
                cache, mask = _select(cache, mask, keep)
            logits, mask = self._decode(cache, mask, last, running)

    def _record(self, req: _Running, d: Draw) -> FinishReason | None:
        req.output.append(d.token)
        req.logprobs.append(d.logprob)
        if d.kept is not None:
            req.kept.append(d.kept.tolist())
        if d.top:
            req.top.append(list(d.top))
        if d.token in req.stop_ids:
            return "stop"
        if req.params.stop and self._hits_stop_string(req):
            return "stop"
        if len(req.output) >= req.params.max_tokens:
            return "length"
        return None

    def _hits_stop_string(self, req: _Running) -> bool:
        """A stop string that ends in the newest token. Earlier text was checked at earlier
        steps, so only a tail is decoded: a string of L characters spans at most 4L byte-level
        tokens (plus one that may end it)."""
        longest = max(map(len, req.params.stop))
        text = self.tokenizer.decode(req.output[-(4 * longest + 1) :])
        return any(s in text for s in req.params.stop)

    def _prefill(self, joining: list[_Running]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        prompts = [r.prompt for r in joining]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        want_prompt = [r.params.prompt_logprobs for r in joining]
        cache = DynamicCache(config=self.model.config)
        with self.router.record(_wants_routing(joining)):
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                cache=cache,
                use_cache=True,
                logits_to_keep=0 if any(want_prompt) else 1,
            )
        self._collect_routing(joining, [width - len(p) for p in prompts])
        for row, req in enumerate(joining):
            if want_prompt[row]:
                n = len(req.prompt)
                logp = torch.log_softmax(out.logits[row, width - n : -1].float(), dim=-1)
                picked = logp.gather(-1, torch.tensor(req.prompt[1:]).unsqueeze(-1)).squeeze(-1)
                req.prompt_logprobs = [float("nan")] + picked.tolist()
        return cache, mask, out.logits[:, -1].float()

    def _decode(
        self, cache: DynamicCache, mask: torch.Tensor, last: list[int], running: list[_Running]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mask = torch.cat([mask, torch.ones(len(last), 1, dtype=mask.dtype)], dim=1)
        positions = mask.sum(1, keepdim=True) - 1
        with self.router.record(_wants_routing(running)):
            out = self.model(
                input_ids=torch.tensor(last).unsqueeze(1),
                attention_mask=mask,
                position_ids=positions,
                cache=cache,
                use_cache=True,
            )
        self._collect_routing(running, [0] * len(running))
        return out.logits[:, -1].float(), mask

    def _collect_routing(self, reqs: list[_Running], left_pad: list[int]) -> None:
        """Append each asking request's routed-expert rows of the last forward pass."""
        if not _wants_routing(reqs):
            return
        rows = self.router.rows(len(reqs))  # [batch, positions, layers, top_k]
        for row, (req, pad) in enumerate(zip(reqs, left_pad, strict=True)):
            if req.params.return_routed_experts:
                req.routing.append(rows[row, pad:].clone())

    def _result(self, req: _Running, reason: FinishReason) -> GenerateResult:
        return GenerateResult(
            request_id=req.request_id,
            prompt_ids=req.prompt,
            output_ids=req.output,
            output_logprobs=req.logprobs,
            finish_reason=reason,
            sampling_mask=SamplingMask.from_lists(req.kept) if req.kept else None,
            weight_version=self.weight_version,
            prompt_logprobs=req.prompt_logprobs,
            top_logprobs=req.top if req.params.top_logprobs else None,
            routed_experts=(
                torch.cat(req.routing)[req.params.routed_experts_start :]
                if req.params.return_routed_experts
                else None
            ),
            routed_experts_start=req.params.routed_experts_start,
        )


def _wants_routing(reqs: list[_Running]) -> bool:
    return any(r.params.return_routed_experts for r in reqs)


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    pad = width - t.shape[dim]
    if pad == 0:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _merge(
    cache: DynamicCache | None,
    mask: torch.Tensor | None,
    new: DynamicCache,
    new_mask: torch.Tensor,
) -> tuple[DynamicCache, torch.Tensor]:
    """Append prefilled requests' cache rows to the batch, left-padding to a common width."""
    if cache is None or mask is None:
        return new, new_mask
    width = max(mask.shape[1], new_mask.shape[1])
    for layer, joining in zip(cache.layers, new.layers, strict=True):
        layer.keys = torch.cat([_left_pad(layer.keys, width, 2), _left_pad(joining.keys, width, 2)])
        layer.values = torch.cat(
            [_left_pad(layer.values, width, 2), _left_pad(joining.values, width, 2)]
        )
    return cache, torch.cat([_left_pad(mask, width, 1), _left_pad(new_mask, width, 1)])


def _select(
    cache: DynamicCache, mask: torch.Tensor, rows: list[int]
) -> tuple[DynamicCache, torch.Tensor]:
    """Keep ``rows`` of the batch and trim left padding no remaining row needs."""
    index = torch.tensor(rows)
    mask = mask[index]
    lead = int((mask.cumsum(1) == 0).sum(1).min())
    for layer in cache.layers:
        layer.keys = layer.keys[index, :, lead:]
        layer.values = layer.values[index, :, lead:]
    return cache, mask[:, lead:]
