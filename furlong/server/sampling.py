"""Sampling in the Tinker service: sampling sessions, their rollout engines, and the translation
of Tinker's ``SampleRequest`` into furlong's :class:`SamplingParams`.

A sampler samples either a served base model (one engine per base, shared by every tenant) or
a sampler snapshot (``save_weights_for_sampler``): an independent copy of the weights it was
made from, so training goes on without changing it. Each engine is fed fairly across tenants
by a :class:`FairFeeder`; loaded snapshots are kept for reuse (LRU).

Hostile input is bounded before it is allocated: prompt + ``max_tokens`` within the model's
context, and ``num_samples`` / ``max_tokens`` / top-k caps.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinker import types as tt

from furlong.errors import InputError
from furlong.rollout.base import GenerateResult
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sampling import MAX_SEED, SamplingParams, fit_max_tokens
from furlong.server import proto
from furlong.server.futures import Failure, FutureStore
from furlong.server.models import ModelPool, sampling_model
from furlong.server.sample_feeder import FairFeeder
from furlong.server.sessions import NotFound, Sessions
from furlong.server.state import CheckpointRef, StateDir

if TYPE_CHECKING:
    from furlong.server.service import ServiceConfig


@dataclass
class _Sampler:
    owner: str
    feeder: FairFeeder
    base_model: str
    model_path: str | None  # tinker://…/sampler_weights/…, or None for the base model


@dataclass
class Sampling:
    config: ServiceConfig
    pool: ModelPool
    sessions: Sessions
    state: StateDir
    futures: FutureStore
    _samplers: dict[str, _Sampler] = field(default_factory=dict, init=False)  # by session id
    _base_feeders: dict[str, FairFeeder] = field(default_factory=dict, init=False)  # by base
    _snapshots: OrderedDict[Path, FairFeeder] = field(default_factory=OrderedDict, init=False)
    # HTTP, compute and threadpool threads share the snapshot cache
    _snapshots_lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def create_sampling_session(self, owner: str, req: tt.CreateSamplingSessionRequest) -> str:
        self.sessions.check(owner, req.session_id)
        if req.model_path:
            ref = CheckpointRef.parse(req.model_path, "model_path")
            if ref.segment != "sampler_weights":
                raise InputError(
                    "model_path: sample from a sampler_weights/ path "
                    "(save_weights_for_sampler), not a training-state path"
                )
            base = (self.state.read_run(ref.run_id) or {}).get("base_model", "")
            return self.new_sampler(owner, base, ref.uri)
        if not req.base_model:
            raise InputError("base_model: required when no model_path is given")
        self.pool.check_served(req.base_model)
        return self.new_sampler(owner, req.base_model, None)

    def new_sampler(self, owner: str, base_model: str, model_path: str | None) -> str:
        feeder = self._feeder(owner, base_model, model_path)
        sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        self._samplers[sampler_id] = _Sampler(owner, feeder, base_model, model_path)
        return sampler_id

    def _feeder(self, owner: str, base_model: str, model_path: str | None) -> FairFeeder:
        """The fair feeder of a rollout engine over a base model or over a sampler snapshot."""
        if model_path is None:
            feeder = self._base_feeders.get(base_model)
            if feeder is None:
                feeder = self._new_feeder(*self.pool.base(base_model))
                self._base_feeders[base_model] = feeder
            return feeder
        path = self.state.owned_checkpoint(owner, CheckpointRef.parse(model_path))
        with self._snapshots_lock:
            feeder = self._snapshots.pop(path, None)
            if feeder is None:  # a snapshot changes only when re-saved, which evicts it
                feeder = self._new_feeder(*sampling_model(self.pool, path))
            self._snapshots[path] = feeder
            while len(self._snapshots) > self.config.snapshot_engines:
                self._snapshots.popitem(last=False)  # live samplers keep their own reference
            return feeder

    def _new_feeder(self, model: Any, tokenizer: Any) -> FairFeeder:
        return FairFeeder(EmbeddedEngine(model, tokenizer, max_running=self.config.sampler_slots))

    def forget_snapshot(self, path: Path) -> None:
        """Drop a snapshot's cached engine (it is being re-saved or deleted)."""
        with self._snapshots_lock:
            self._snapshots.pop(path, None)

    def sampler_info(self, owner: str, sampler_id: str) -> dict:
        s = self._sampler(owner, sampler_id)
        return {"sampler_id": sampler_id, "base_model": s.base_model, "model_path": s.model_path}

    def _sampler(self, owner: str, sampler_id: str) -> _Sampler:
        s = self._samplers.get(sampler_id)
        if s is None or s.owner != owner:
            raise NotFound(f"sampler {sampler_id!r}")
        return s

    def sample(self, owner: str, req: tt.SampleRequest) -> tuple[str, list[str]]:
        """Queue ``num_samples`` sequences; returns the request id and the sequence ids."""
        if req.sampling_session_id:
            feeder = self._sampler(owner, req.sampling_session_id).feeder
        else:  # legacy addressing: no sampling session is registered
            if not req.model_path:
                self.pool.check_served(req.base_model or "")
            feeder = self._feeder(owner, req.base_model or "", req.model_path)
        for name in ("prompt_alt_tokens_k", "target_prompt_logprobs", "record_stability_info"):
            if getattr(req, name, None):
                raise InputError(f"{name}: not supported by furlong")
        if not 1 <= req.num_samples <= self.config.max_samples:
            raise InputError(
                f"num_samples: must be in [1, {self.config.max_samples}], got {req.num_samples}"
            )
        top = self.config.max_top_logprobs
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
            k = getattr(req, name)
            if not 0 <= k <= top:  # each is k entries per token of every sequence returned
                raise InputError(f"{name}: must be in [0, {top}], got {k}")
        if (top_k := req.sampling_params.top_k) < -1:
            raise InputError(f"sampling_params.top_k: -1 or 0 (no limit) or >= 1, got {top_k}")
        prompt = _tokens(req.prompt, "prompt")
        scored_from = _prompt_scored_from(req, len(prompt))
        params = self._sampling_params(req, len(prompt), feeder.engine)
        futures = feeder.submit(owner, [prompt] * req.num_samples, params)  # checked whole
        request_id = self.futures.create(owner)

        def done(_f: Any) -> None:
            if all(f.done() for f in futures):
                self.futures.resolve(request_id, _sample_result(futures, scored_from))

        for f in futures:
            f.add_done_callback(done)
        return request_id, [f"{request_id}-{i}" for i in range(req.num_samples)]

    def _sampling_params(
        self, req: tt.SampleRequest, prompt_len: int, engine: EmbeddedEngine
    ) -> list[SamplingParams]:
        sp = req.sampling_params
        max_tokens = fit_max_tokens(
            sp.max_tokens,
            prompt_len,
            engine.context_length,
            self.config.max_sample_tokens,
            "sampling_params.max_tokens",
        )
        if sp.seed is not None and not 0 <= sp.seed <= MAX_SEED - (req.num_samples - 1):
            raise InputError(  # sample i draws with seed + i
                f"sampling_params.seed: must be in [0, 2**64 - num_samples], got {sp.seed}"
            )
        stop_ids: tuple[int, ...] | None = None
        stop_strings: tuple[str, ...] = ()
        if sp.stop is not None:
            stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop)
            if all(isinstance(s, int) for s in stops):
                stop_ids = tuple(stops)  # [] -> never stop, not even at EOS
                for j, t in enumerate(stop_ids):  # an id outside could never end a sequence
                    if not 0 <= t < engine.vocab_size:
                        raise InputError(
                            f"sampling_params.stop[{j}]: token id {t} outside "
                            f"[0, {engine.vocab_size})"
                        )
            elif all(isinstance(s, str) for s in stops):
                stop_strings = tuple(stops)
            else:
                raise InputError("sampling_params.stop: mixes strings and token ids")
        base = dict(
            max_tokens=max_tokens,
            temperature=sp.temperature,
            top_k=sp.top_k if sp.top_k > 0 else 0,
            top_p=sp.top_p,
            stop_token_ids=stop_ids,
            stop=stop_strings,
            top_logprobs=req.topk_sample_logprobs,
        )
        return [
            SamplingParams(  # checks and names the remaining fields
                **base,
                seed=None if sp.seed is None else sp.seed + i,
                prompt_logprobs=bool(req.prompt_logprobs) and i == 0,
                prompt_top_logprobs=req.topk_prompt_logprobs if i == 0 else 0,
            )
            for i in range(req.num_samples)
        ]


def _tokens(model_input: tt.ModelInput, field_name: str) -> list[int]:
    tokens: list[int] = []
    for j, chunk in enumerate(model_input.chunks):
        if getattr(chunk, "type", None) != "encoded_text":
            raise InputError(f"{field_name}.chunks[{j}]: only encoded_text chunks are supported")
        tokens.extend(int(t) for t in chunk.tokens)
    if not tokens:
        raise InputError(f"{field_name}: empty")
    return tokens


def _prompt_scored_from(req: tt.SampleRequest, prompt_len: int) -> int:
    """The first prompt position whose log-probs are returned (``prompt_logprobs_last_n``)."""
    last_n = req.prompt_logprobs_last_n
    if last_n is None:
        return 1
    if not req.prompt_logprobs:
        raise InputError("prompt_logprobs_last_n: requires prompt_logprobs")
    if not 1 <= last_n <= prompt_len - 1:
        raise InputError(
            f"prompt_logprobs_last_n: must be in [1, {prompt_len - 1}] for this prompt, "
            f"got {last_n}"
        )
    return prompt_len - last_n


def _sample_result(futures: list, scored_from: int) -> Any:
    try:
        results: list[GenerateResult] = [f.result() for f in futures]
    except InputError as e:
        return Failure(str(e), "user")
    except Exception as e:  # noqa: BLE001 - reported to the client, not raised in a callback
        return Failure(f"{type(e).__name__}: {e}", "server")
    sequences = [
        proto.SampledSeq(
            tokens=r.output_ids,
            logprobs=r.output_logprobs,
            stop_reason="length" if r.finish_reason == "length" else "stop",
            topk=r.top_logprobs,
        )
        for r in results
    ]
    first = results[0]
    prompt_lp, prompt_top = first.prompt_logprobs, first.prompt_top_logprobs
    if prompt_lp is not None:
        prompt_lp = [None] * scored_from + prompt_lp[scored_from:]
    if prompt_top is not None:
        prompt_top = [None] * scored_from + prompt_top[scored_from:]
    return proto.encode_sample_response(sequences, prompt_lp, prompt_top)
