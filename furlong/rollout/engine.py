"""The embedded rollout engine: continuous batching over an HF causal LM with a KV cache.

Requests join the running batch as soon as a slot is free and leave as soon as they stop, so
short answers never wait for long ones. The batch shares one left-padded KV cache: requests
joining at the same step are prefilled together and their cache rows are padded into the
batch; a leaving request is selected out and common left padding is trimmed. Every generated
token comes with its log-prob under the distribution actually sampled from and, on request,
its kept set (a ``SamplingMask``).

One driver at a time runs the batch: the thread calling :meth:`generate` when the engine is
idle (so a trainer and the engine in one process share one intra-op thread pool; two pools
contend on a small CPU), otherwise a worker thread started for requests from :meth:`submit`
(an HTTP front end). ``pause``, ``update_weights``, ``abort`` and the memory calls may come
from other threads and take effect between two steps.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from furlong.errors import InputError
from furlong.host_memory import release_host_memory
from furlong.models.fast_forward import FastForward
from furlong.rollout import kv_cache
from furlong.rollout.base import (
    FinishReason,
    GenerateResult,
    MemoryBytes,
    MemoryTag,
    PauseMode,
    Weights,
    check_pause_mode,
    check_tags,
    check_weight_shapes,
    expand_params,
)
from furlong.rollout.routing import RoutingRecorder
from furlong.rollout.sampling import (
    Draw,
    SamplingParams,
    csr_tensor,
    draw_batch,
    request_generator,
)
from furlong.rollout.sampling_mask import SamplingMask


@dataclass
class _Request:
    request_id: int | str
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    future: Future = field(default_factory=Future)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    kept: list[list[int]] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None
    prompt_top: list[list[tuple[int, float]] | None] | None = None
    prompt_target: torch.Tensor | None = None  # log-probs of params.prompt_target_ids
    routing: list[torch.Tensor] = field(default_factory=list)  # [positions, layers, top_k] parts


@dataclass
class _Batch:
    """The running requests and their shared state; only the worker touches it while it runs."""

    running: list[_Request] = field(default_factory=list)
    cache: Any = None  # DynamicCache over the running rows
    mask: torch.Tensor | None = None  # [B, T] attention mask (left padding = 0)
    logits: torch.Tensor | None = None  # [B, V] fp32, next-token logits of every running row

    def clear(self) -> None:
        self.running, self.cache, self.mask, self.logits = [], None, None, None


class EmbeddedEngine:
    """Rollout on an in-process HF model (the CPU default; also the tests' reference)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        max_running: int = 16,
        fast_forward: bool = True,
    ):
        """``fast_forward``: run dense Qwen3/Qwen2/Llama models through :class:`FastForward`
        (same logits, less per-step overhead); other models always use the HF forward."""
        self.model = model.eval()
        self._fast = FastForward(model) if fast_forward and FastForward.supports(model) else None
        self.tokenizer = tokenizer
        self.max_running = max_running
        self.weight_version = 0
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_output_embeddings().out_features)
        # prompt + max_tokens beyond this is refused before any KV cache is allocated
        self.context_length: int | None = getattr(model.config, "max_position_embeddings", None)
        eos = model.generation_config.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.router = RoutingRecorder(model)
        self.steps = 0  # batch steps run so far (progress, for monitoring and tests)
        self._ids = itertools.count()
        self._cond = threading.Condition()  # guards everything below
        self._model_lock = threading.RLock()  # held while the model runs or its weights change
        self._queue: deque[_Request] = deque()
        self._batch = _Batch()
        self._worker: threading.Thread | None = None  # the thread driving the batch, if any
        self._pause_request: PauseMode | None = None
        self._to_abort: set[int] = set()  # id() of running requests to end at the boundary
        self._paused = False
        self._offloaded: set[MemoryTag] = set()
        self._host_weights: dict[str, torch.Tensor] = {}  # while "weights" is offloaded

    # ---------------------------------------------------------------- requests

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerateResult]:
        """Generate for every prompt (results in request order), batching continuously. The
        whole request is validated before anything is queued. While the engine is paused or
        offloaded, requests wait for ``resume`` / ``onload``. When nothing else is driving the
        batch, the calling thread does."""
        futures = self.submit_many(prompts, params, _start_worker=False)
        with self._cond:
            drive = self._worker is None and self._can_step()
            if drive:
                self._worker = threading.current_thread()
        if drive:
            self._serve(until=lambda: all(f.done() for f in futures))
        return [f.result() for f in futures]

    def submit_many(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        request_ids: Sequence[str] | None = None,
        _start_worker: bool = True,
    ) -> list[Future[GenerateResult]]:
        """Validate every request, then queue them all; each future resolves when its request
        finishes (or is aborted)."""
        plist = expand_params(len(prompts), params)
        ids = [None] * len(prompts) if request_ids is None else list(request_ids)
        if len(ids) != len(prompts):
            raise InputError(f"request_ids: {len(ids)} for {len(prompts)} prompts")
        requests = [
            self._request(i, p, sp, rid)
            for i, (p, sp, rid) in enumerate(zip(prompts, plist, ids, strict=True))
        ]
        with self._cond:
            self._queue.extend(requests)
            if _start_worker:
                self._wake()
        return [r.future for r in requests]

    def submit(
        self, prompt: Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> Future[GenerateResult]:
        """Queue one request; the future resolves when it finishes (or is aborted)."""
        ids = None if request_id is None else [request_id]
        return self.submit_many([prompt], [params], ids)[0]

    def abort(self, request_ids: Iterable[int | str] | None = None) -> int:
        """End queued and running requests (all when ``request_ids`` is None) with finish
        reason ``abort`` and their partial output, at the next step boundary. Returns how many
        were found."""
        wanted = None if request_ids is None else set(request_ids)
        with self._cond:
            hits = [
                r
                for r in [*self._queue, *self._batch.running]
                if wanted is None or r.request_id in wanted
            ]
            ids = {id(r) for r in hits}
            for request in [r for r in self._queue if id(r) in ids]:
                self._queue.remove(request)
                self._finish_aborted(request)
            self._to_abort |= {id(r) for r in self._batch.running if id(r) in ids}
            if self._worker is None:  # nobody is stepping the batch: leave it now
                self._leave_aborted()
            else:
                while self._to_abort:
                    self._cond.wait()
            return len(hits)

    def _finish_aborted(self, request: _Request) -> None:
        request.future.set_result(self._result(request, "abort", self.weight_version))

    def _leave_aborted(self) -> None:
        """Finish the running requests marked for abort and select them out (``_cond`` held,
        no step in progress)."""
        if not self._to_abort:
            return
        batch = self._batch
        keep = [i for i, r in enumerate(batch.running) if id(r) not in self._to_abort]
        for request in batch.running:
            if id(request) in self._to_abort:
                self._finish_aborted(request)
        if keep:
            batch.cache, batch.mask = kv_cache.select(batch.cache, batch.mask, keep)
            batch.logits = batch.logits[keep]
            batch.running = [batch.running[i] for i in keep]
        else:
            batch.clear()
        self._to_abort.clear()
        self._cond.notify_all()

    def check_requests(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> None:
        """Validate requests exactly as :meth:`submit_many` would, queueing nothing (a front
        end that feeds the engine in waves checks the whole request first)."""
        plist = expand_params(len(prompts), params)
        for i, (prompt, sp) in enumerate(zip(prompts, plist, strict=True)):
            self._check_request(i, prompt, sp)

    def _check_request(self, index: int, prompt: Sequence[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise InputError(f"params[{index}]: expected SamplingParams, got {type(params)}")
        if not prompt:
            raise InputError(f"prompts[{index}]: empty")
        bad = [t for t in prompt if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise InputError(f"prompts[{index}]: token id {bad[0]} outside [0, {self.vocab_size})")
        targets = params.prompt_target_ids
        if targets is not None:
            if targets.shape[0] != len(prompt) - 1:
                raise InputError(
                    f"params[{index}].prompt_target_ids: {targets.shape[0]} rows for a prompt of "
                    f"{len(prompt)} tokens; expected len(prompt) - 1 = {len(prompt) - 1}"
                )
            values = targets.values() if targets.layout == torch.sparse_csr else targets
            if values.numel() and int(values.max()) >= self.vocab_size:
                raise InputError(
                    f"params[{index}].prompt_target_ids: token id {int(values.max())} outside "
                    f"[0, {self.vocab_size})"
                )
        if params.return_routed_experts and not self.router.is_moe:
            raise InputError(f"params[{index}].return_routed_experts: the model has no MoE routers")
        context = self.context_length
        if context is not None and len(prompt) + params.max_tokens > context:
            raise InputError(
                f"params[{index}].max_tokens: {len(prompt)} prompt tokens + max_tokens "
                f"{params.max_tokens} exceed the model's context of {context}"
            )

    def _request(
        self,
        index: int,
        prompt: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> _Request:
        self._check_request(index, prompt, params)
        return _Request(
            request_id=next(self._ids) if request_id is None else request_id,
            prompt=[int(t) for t in prompt],
            params=params,
            stop_ids=self.stop_ids(params),
            generator=request_generator(params.seed),
        )

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The token ids that end a request: its own, or the model's EOS when it names none."""
        ids = params.stop_token_ids
        return self.eos_ids if ids is None else frozenset(ids)

    # ---------------------------------------------------------------- weights

    @torch.no_grad()
    def update_weights(
        self, weights: Weights, version: int | None = None, *, final: bool = True
    ) -> int:
        """Publish new weights (a state dict in process, or a safetensors file / HF directory
        across processes). Every name and shape is checked before any copy; the copy happens
        between two decode steps (pause first to control what in-flight requests see).
        Returns the new weight version (``version`` or the old one + 1), which every result
        finished afterwards carries. Bucketed publication: send the tensors in several calls
        with ``final=False`` and the last with ``final=True``; only the last one moves the
        version (each bucket is checked whole before it is copied)."""
        if isinstance(weights, str | os.PathLike):
            path = Path(weights)
            files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
            if not files or not all(f.is_file() for f in files):
                raise InputError(f"update_weights: no safetensors file at {path}")
            weights = {k: v for f in files for k, v in load_file(str(f)).items()}
        with self._model_lock:
            self.check_weights(weights)
            targets = self._weight_targets()
            for name, tensor in weights.items():
                targets[name].copy_(tensor)
            if final:
                self.weight_version = self.weight_version + 1 if version is None else int(version)
            return self.weight_version

    def check_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Raise :class:`InputError` unless every tensor names one of the model's parameters
        with its shape: what :meth:`update_weights` checks, for a caller that must know before
        it pauses generation for a publication. Names and shapes never change, so this does
        not wait for a running step."""
        check_weight_shapes(weights, self.weight_shapes())

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each publishable tensor's name and shape."""
        return {name: tuple(t.shape) for name, t in self._weight_targets().items()}

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        if "weights" in self._offloaded:
            return self._host_weights
        return {name: p.data for name, p in self.model.named_parameters()}

    # ---------------------------------------------------------------- pause / resume

    def pause(self, mode: PauseMode = "retract") -> None:
        """Stop generating at the next step boundary. ``abort``: in-flight and queued requests
        end now with finish reason ``abort`` and their partial output; ``retract``: in-flight
        requests go back to the queue, their prefix recomputed on resume; ``in_place``: they
        are frozen with their KV cache and continue from it on resume. Returns once applied."""
        mode = check_pause_mode(mode)
        with self._cond:
            if self._worker is None:
                self._apply_pause(mode)
                return
            self._pause_request = mode
            while self._pause_request is not None:
                self._cond.wait()

    def resume(self) -> None:
        """Continue after :meth:`pause` (a no-op when not paused)."""
        with self._cond:
            self._paused = False
            self._wake()

    @property
    def busy(self) -> bool:
        """Requests are queued or in the batch (running or frozen)."""
        return bool(self._queue or self._batch.running)

    @property
    def paused(self) -> bool:
        return self._paused

    def _apply_pause(self, mode: PauseMode) -> None:
        """Runs with ``_cond`` held and no step in progress."""
        batch = self._batch
        if mode == "abort":
            for request in [*batch.running, *self._queue]:
                self._finish_aborted(request)
            self._queue.clear()
            batch.clear()
        elif mode == "retract":
            for request in batch.running:
                _keep_sampled_routes(request)
            self._queue.extendleft(reversed(batch.running))
            batch.clear()
        self._pause_request, self._paused = None, True
        self._cond.notify_all()

    # ---------------------------------------------------------------- memory

    def offload(self, tags: Iterable[MemoryTag]) -> None:
        """Release memory for a colocated trainer: ``kv_cache`` (the cache of requests frozen by
        an ``in_place`` pause moves to host memory) and ``weights`` (parameters move to host
        memory; on CPU they are detached from the model). Generation waits until ``onload``.
        Each tag must be onloaded before it is offloaded again."""
        tags = check_tags(tags)
        with self._cond:
            again = [t for t in tags if t in self._offloaded]
            if again:
                raise InputError(f"offload: {again} already offloaded (onload first)")
            if self._worker is not None:
                raise InputError("offload: requests are running; pause() or wait for them first")
            with self._model_lock:
                if "kv_cache" in tags and self._batch.cache is not None:
                    kv_cache.move(self._batch.cache, "cpu")
                if "weights" in tags:
                    for name, p in self.model.named_parameters():
                        self._host_weights[name] = p.data.to("cpu")
                        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                self._offloaded.update(tags)
            _release_device_cache(self.device)

    def onload(self, tags: Iterable[MemoryTag]) -> None:
        """Bring back exactly what :meth:`offload` released."""
        tags = check_tags(tags)
        with self._cond:
            missing = [t for t in tags if t not in self._offloaded]
            if missing:
                raise InputError(f"onload: {missing} not offloaded")
            with self._model_lock:
                if "weights" in tags:
                    for name, p in self.model.named_parameters():
                        p.data = self._host_weights.pop(name).to(self.device)
                if "kv_cache" in tags and self._batch.cache is not None:
                    kv_cache.move(self._batch.cache, self.device)
                self._offloaded.difference_update(tags)
            self._wake()

    @property
    def offloaded(self) -> frozenset[str]:
        return frozenset(self._offloaded)

    def memory_bytes(self) -> MemoryBytes:
        with self._cond:
            cache = self._batch.cache
            live = cache is not None and "kv_cache" not in self._offloaded
            return {
                "weights": sum(p.data.nbytes for p in self.model.parameters()),
                "kv_cache": kv_cache.nbytes(cache) if live else 0,
                "mirror": sum(t.nbytes for t in self._host_weights.values()),
            }

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Nothing to release: the engine lives in this process."""

    # ---------------------------------------------------------------- worker

    def _wake(self) -> None:
        """Start the worker if there is work it may do (``_cond`` held)."""
        if self._worker is None and self._can_step():
            self._worker = threading.Thread(target=self._serve, name="furlong-rollout", daemon=True)
            self._worker.start()

    def _can_step(self) -> bool:
        return not (self._paused or self._offloaded) and bool(self._queue or self._batch.running)

    def _serve(self, until: Callable[[], bool] | None = None) -> None:
        """Run steps while there is work (a calling thread: until ``until()`` holds, then any
        remaining work goes to a worker thread)."""
        try:
            while True:
                with self._cond:
                    self._leave_aborted()
                    if self._pause_request is not None:
                        self._apply_pause(self._pause_request)
                    if not self._can_step() or (until is not None and until()):
                        self._worker = None
                        self._wake()
                        self._cond.notify_all()
                        return
                    free = self.max_running - len(self._batch.running)
                    joining = [self._queue.popleft() for _ in range(min(free, len(self._queue)))]
                try:
                    with self._model_lock, torch.inference_mode():
                        finished = self._step(joining)
                except Exception as exc:  # fail the batch's requests, keep serving the rest
                    for request in {id(r): r for r in [*self._batch.running, *joining]}.values():
                        request.future.set_exception(exc)
                    self._batch.clear()
                    release_host_memory()  # a failed (e.g. oversized) step's cache goes back
                    continue
                for request, reason, version in finished:
                    request.future.set_result(self._result(request, reason, version))
        except BaseException:  # e.g. KeyboardInterrupt in a calling thread: release the batch
            with self._cond:
                if self._worker is threading.current_thread():
                    self._worker = None
                self._cond.notify_all()
            raise

    def _step(self, joining: list[_Request]) -> list[tuple[_Request, FinishReason, int]]:
        """Prefill the joiners, draw one token for every running request, let finished ones
        leave, and decode the rest (their next logits wait for the next step)."""
        self.steps += 1
        batch = self._batch
        if joining:  # one left-padded prefill for everyone joining at this step
            cache, mask, logits = self._prefill(joining)
            batch.cache, batch.mask = kv_cache.merge(batch.cache, batch.mask, cache, mask)
            batch.logits = logits if batch.logits is None else torch.cat([batch.logits, logits])
            batch.running.extend(joining)
        running = batch.running
        draws = draw_batch(
            batch.logits, [r.params for r in running], [r.generator for r in running]
        )
        keep, last, finished = [], [], []
        for row, (request, d) in enumerate(zip(running, draws, strict=True)):
            reason = self._record(request, d)
            if reason is None:
                keep.append(row)
                last.append(request.output[-1])
            else:
                finished.append((request, reason, self.weight_version))
        if not keep:
            batch.clear()
            return finished
        if len(keep) < len(running):  # leave
            batch.running = [running[i] for i in keep]
            batch.cache, batch.mask = kv_cache.select(batch.cache, batch.mask, keep)
        batch.logits, batch.mask = self._decode(batch.cache, batch.mask, last, batch.running)
        return finished

    def _record(self, request: _Request, d: Draw) -> FinishReason | None:
        request.output.append(d.token)
        request.logprobs.append(d.logprob)
        if d.kept is not None:
            request.kept.append(d.kept.tolist())
        if d.top:
            request.top.append(list(d.top))
        if d.token in request.stop_ids:
            return "stop"
        if request.params.stop and self._hits_stop_string(request):
            return "stop"
        if len(request.output) >= request.params.max_tokens:
            return "length"
        return None

    def _hits_stop_string(self, request: _Request) -> bool:
        """A stop string that ends in the newest token. Earlier text was checked at earlier
        steps, so only a tail is decoded: a string of L characters spans at most 4L byte-level
        tokens (plus one that may end it)."""
        longest = max(map(len, request.params.stop))
        text = self.tokenizer.decode(request.output[-(4 * longest + 1) :])
        return any(s in text for s in request.params.stop)

    def _prefill(self, joining: list[_Request]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Prefill prompt + output so far (a retracted request recomputes its prefix)."""
        seqs = [r.prompt + r.output for r in joining]
        width = max(map(len, seqs))
        ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs], device=self.device)
        mask = torch.tensor(
            [[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=self.device
        )
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
                n = len(request.prompt)
                logp = torch.log_softmax(logits[row, width - n : -1].float(), dim=-1)
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
        return cache, mask, logits[:, -1].float()

    def _prefill_once(
        self, seqs: list[list[int]], width: int
    ) -> tuple[Any, torch.Tensor, torch.Tensor] | None:
        """Prefill each distinct sequence once and copy its cache rows and logits to every
        request that joins with it; None when all are distinct."""
        distinct: dict[tuple[int, ...], int] = {}
        owner = [distinct.setdefault(tuple(s), len(distinct)) for s in seqs]
        if len(distinct) == len(seqs):
            return None
        unique = [list(s) for s in distinct]
        ids = torch.tensor([[0] * (width - len(s)) + s for s in unique], device=self.device)
        mask = torch.tensor(
            [[0] * (width - len(s)) + [1] * len(s) for s in unique], device=self.device
        )
        cache = kv_cache.new_cache(self.model.config)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits = self._forward(ids, mask, positions, cache, 1)
        index = torch.tensor(owner, device=self.device)
        cache, mask = kv_cache.expand(cache, mask, index)
        return cache, mask, logits[index, -1].float()

    def _decode(
        self, cache: Any, mask: torch.Tensor, last: list[int], running: list[_Request]
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
        if self._fast is not None:
            return self._fast(ids, mask, positions, cache, logits_to_keep)
        return self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        ).logits

    def _collect_routing(self, requests: list[_Request], first: list[int]) -> None:
        """Append each asking request's routed-expert rows of the last forward pass, from its
        row ``first`` on (past the left padding, and past rows it already holds)."""
        if not _wants_routing(requests):
            return
        rows = self.router.rows(len(requests))  # [batch, positions, layers, top_k]
        for row, (request, start) in enumerate(zip(requests, first, strict=True)):
            if request.params.return_routed_experts:
                request.routing.append(rows[row, start:].cpu())

    def _result(self, request: _Request, reason: FinishReason, version: int) -> GenerateResult:
        params = request.params
        routed = None
        if params.return_routed_experts:
            # an aborted request has also fed its last token; rows stop before it
            end = len(request.prompt) + len(request.output) - 1
            rows = torch.cat(request.routing)[:end] if request.routing else self._no_rows()
            routed = rows[params.routed_experts_start :].to(torch.int32, copy=True)
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

    def _no_rows(self) -> torch.Tensor:
        top_k = getattr(self.model.config, "num_experts_per_tok", 0)
        return torch.empty(0, len(self.router.routers), top_k, dtype=torch.int32)


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


def _routed(request: _Request) -> int:
    """Positions whose routed-expert rows the request has recorded so far."""
    return sum(int(rows.shape[0]) for rows in request.routing)


def _keep_sampled_routes(request: _Request) -> None:
    """On a retract, keep the rows of every position whose logits were sampled from (the
    prompt and every output token but the last); the last token's logits are discarded and
    recomputed with the prefix, so its row is too. Replaying a recomputed row (routing under
    the new weights) for a token sampled under the old routing is the bug R3 exists to avoid."""
    if request.routing:
        used = len(request.prompt) + len(request.output) - 1
        request.routing = [torch.cat(request.routing)[:used]]


def _wants_routing(requests: list[_Request]) -> bool:
    return any(r.params.return_routed_experts for r in requests)


def _release_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
