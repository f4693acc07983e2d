"""The embedded rollout engine: continuous batching over an HF causal LM with a KV cache.

Requests join the running batch as soon as a slot is free and leave as soon as they stop, so
short answers never wait for long ones. The batch shares one left-padded KV cache: requests
joining at the same step are prefilled together and their cache rows are padded into the
batch; a leaving request's place goes to a row from the end of the batch (``kv_cache.select``:
no re-layout of the cache). Every generated
token comes with its log-prob under the distribution actually sampled from and, on request,
its kept set (a ``SamplingMask``).

One driver at a time runs the batch: the thread calling :meth:`generate` when the engine is
idle (so a trainer and the engine in one process share one intra-op thread pool; two pools
contend on a small CPU), otherwise a worker thread started for requests from :meth:`submit`
(an HTTP front end). ``pause``, ``update_weights``, ``abort`` and the memory calls may come
from other threads and take effect between two steps.

This module is the scheduler: the queue, the batch, the driving thread, pause and abort. Every
forward pass and weight change goes to a :class:`~furlong.rollout.model_runner.ModelRunner`;
a request's validation, drawn tokens and result are in :mod:`furlong.rollout.request_state`.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from furlong.errors import InputError
from furlong.host_memory import release_host_memory
from furlong.rollout import kv_cache
from furlong.rollout.base import (
    FinishReason,
    GenerateResult,
    MemoryBytes,
    MemoryTag,
    PauseMode,
    RolloutEngine,
    SamplingEngine,
    SessionEngine,
    Weights,
    check_pause_mode,
    check_tags,
    expand_params,
)
from furlong.rollout.model_runner import ModelRunner, keep_sampled_routes, read_weights
from furlong.rollout.registry import EngineRequest
from furlong.rollout.request_state import RequestState, check_request, record, result
from furlong.rollout.routing import RoutingRecorder
from furlong.rollout.sampling import Draw, SamplingParams, draw_batch, request_generator


@dataclass
class _Batch:
    """The running requests and their shared state; only the worker touches it while it runs."""

    running: list[RequestState] = field(default_factory=list)
    cache: Any = None  # DynamicCache over the running rows
    mask: torch.Tensor | None = None  # [B, T] attention mask (left padding = 0)
    logits: torch.Tensor | None = None  # [B, V] fp32, next-token logits of every running row

    def clear(self) -> None:
        self.running, self.cache, self.mask, self.logits = [], None, None, None

    def keep(self, rows: list[int]) -> None:
        """Keep ``rows`` (ascending, not empty): their cache, mask, requests and next logits, in
        the order ``kv_cache.select`` leaves them."""
        assert self.mask is not None  # running rows: prefilled
        self.cache, self.mask, order = kv_cache.select(self.cache, self.mask, rows)
        self.running = [self.running[i] for i in order]
        if self.logits is not None:
            self.logits = self.logits[order]


class EmbeddedEngine:
    """Rollout on an in-process HF model (the CPU default; also the tests' reference).

    This is the scheduler; every forward pass and weight change goes to its
    :class:`~furlong.rollout.model_runner.ModelRunner`."""

    # what the front doors' protocols read (furlong.rollout.base), set in __init__
    tokenizer: Any
    router: RoutingRecorder
    context_length: int | None
    weight_version: int
    max_running: int
    vocab_size: int

    @classmethod
    def from_request(cls, request: EngineRequest) -> EmbeddedEngine:
        """The registry's ``embedded`` kind (a copy of the model when the caller trains it)."""
        return cls(request.model_to_serve(), request.tokenizer, max_running=request.max_running)

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        max_running: int = 16,
        fast_forward: bool = True,
    ):
        """``fast_forward``: run dense Qwen3/Qwen2/Llama models through :class:`FastForward`
        (same logits, less per-step overhead); other models always use the HF forward."""
        self._runner = ModelRunner(model, fast_forward)
        self.model = self._runner.model
        self.tokenizer = tokenizer
        self.max_running = max_running
        self.weight_version = 0
        self.device = self._runner.device
        self.vocab_size = int(model.get_output_embeddings().out_features)
        # prompt + max_tokens beyond this is refused before any KV cache is allocated
        self.context_length: int | None = getattr(model.config, "max_position_embeddings", None)
        eos = model.generation_config.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.router = self._runner.router
        self.steps = 0  # batch steps run so far (progress, for monitoring and tests)
        self._ids = itertools.count()
        self._arrivals = itertools.count()  # request order, kept through retracts
        self._cond = threading.Condition()  # guards everything below
        self._queue: deque[RequestState] = deque()
        self._batch = _Batch()
        self._worker: threading.Thread | None = None  # the thread driving the batch, if any
        self._pause_request: PauseMode | None = None
        self._to_abort: set[int] = set()  # id() of running requests to end at the boundary
        self._paused = False

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

    def _finish_aborted(self, request: RequestState) -> None:
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
            batch.keep(keep)
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
        check_request(
            index, prompt, params, self.vocab_size, self.context_length, self.router.is_moe
        )

    def _request(
        self,
        index: int,
        prompt: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> RequestState:
        self._check_request(index, prompt, params)
        return RequestState(
            request_id=next(self._ids) if request_id is None else request_id,
            prompt=[int(t) for t in prompt],
            params=params,
            stop_ids=self.stop_ids(params),
            generator=request_generator(params.seed),
            arrival=next(self._arrivals),
        )

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The token ids that end a request: its own, or the model's EOS when it names none."""
        ids = params.stop_token_ids
        return self.eos_ids if ids is None else frozenset(ids)

    # ---------------------------------------------------------------- weights

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
        weights = read_weights(weights)
        with self._runner.lock:  # a step sees the new weights with their version
            self._runner.update_weights(weights)
            if final:
                self.weight_version = self.weight_version + 1 if version is None else int(version)
            return self.weight_version

    def check_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Raise :class:`InputError` unless every tensor names one of the model's parameters
        with its shape: what :meth:`update_weights` checks, for a caller that must know before
        it pauses generation for a publication. Names and shapes never change, so this does
        not wait for a running step."""
        self._runner.check_weights(weights)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each publishable tensor's name and shape."""
        return self._runner.weight_shapes()

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
                keep_sampled_routes(request)
            # back to the queue's front in arrival order (leaves reorder the batch's rows)
            self._queue.extendleft(sorted(batch.running, key=lambda r: r.arrival, reverse=True))
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
            again = [t for t in tags if t in self._runner.offloaded]
            if again:
                raise InputError(f"offload: {again} already offloaded (onload first)")
            if self._worker is not None:
                raise InputError("offload: requests are running; pause() or wait for them first")
            self._runner.offload(tags, self._batch.cache)

    def onload(self, tags: Iterable[MemoryTag]) -> None:
        """Bring back exactly what :meth:`offload` released."""
        tags = check_tags(tags)
        with self._cond:
            missing = [t for t in tags if t not in self._runner.offloaded]
            if missing:
                raise InputError(f"onload: {missing} not offloaded")
            self._runner.onload(tags, self._batch.cache)
            self._wake()

    @property
    def offloaded(self) -> frozenset[str]:
        return frozenset(self._runner.offloaded)

    def memory_bytes(self) -> MemoryBytes:
        with self._cond:
            return self._runner.memory_bytes(self._batch.cache)

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
        idle = self._paused or self._runner.offloaded
        return not idle and bool(self._queue or self._batch.running)

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
                    with self._runner.lock, torch.inference_mode():
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

    def _step(self, joining: list[RequestState]) -> list[tuple[RequestState, FinishReason, int]]:
        """Prefill the joiners, draw one token for every running request, let finished ones
        leave, and decode the rest (their next logits wait for the next step)."""
        self.steps += 1
        batch = self._batch
        if joining:  # one left-padded prefill for everyone joining at this step
            cache, mask, logits = self._runner.prefill(joining)
            batch.cache, batch.mask = kv_cache.merge(batch.cache, batch.mask, cache, mask)
            batch.logits = logits if batch.logits is None else torch.cat([batch.logits, logits])
            batch.running.extend(joining)
        assert batch.mask is not None and batch.logits is not None  # running rows: prefilled
        running = batch.running
        draws = draw_batch(
            batch.logits, [r.params for r in running], [r.generator for r in running]
        )
        keep, finished = [], []
        for row, (request, d) in enumerate(zip(running, draws, strict=True)):
            reason = self._record(request, d)
            if reason is None:
                keep.append(row)
            else:
                finished.append((request, reason, self.weight_version))
        if not keep:
            batch.clear()
            return finished
        batch.logits = None  # drawn from: the decode below gives the next ones
        if len(keep) < len(running):  # leave
            batch.keep(keep)
        last = [request.output[-1] for request in batch.running]
        batch.logits, batch.mask = self._runner.decode(batch.cache, batch.mask, last, batch.running)
        return finished

    def _record(self, request: RequestState, d: Draw) -> FinishReason | None:
        return record(request, d, self.tokenizer)

    def _result(self, request: RequestState, reason: FinishReason, version: int) -> GenerateResult:
        wants = request.params.return_routed_experts
        return result(
            request, reason, version, self._runner.routed_experts(request) if wants else None
        )


if TYPE_CHECKING:
    # mypy holds the kind to each protocol it serves, signatures included (the registry's
    # run-time check reads only the names); one function per protocol, so that an error names
    # the missing or mismatched member

    def _rollout(engine: EmbeddedEngine) -> RolloutEngine:
        return engine

    def _session(engine: EmbeddedEngine) -> SessionEngine:
        return engine

    def _sampling(engine: EmbeddedEngine) -> SamplingEngine:
        return engine
