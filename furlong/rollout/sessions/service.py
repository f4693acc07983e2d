"""The session server's logic, independent of HTTP: open / turn / assemble / close, and weight
publication under the configured pause mode.

A turn renders the request's messages (token-in/token-out: the session's own sampled ids are
spliced in), plans against the checkpoint, asks the engine for one completion (with the R3
offset the mode allows), and commits a record only when the completion was not aborted.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from furlong.errors import InputError
from furlong.rollout.base import GenerateResult, SessionEngine, Weights
from furlong.rollout.control import ControlPolicy
from furlong.rollout.sample import Sample, truncate_response
from furlong.rollout.sampling import SamplingParams, fit_max_tokens
from furlong.rollout.sessions.chat import ChatRequest, Message, completion_body, parse_chat_request
from furlong.rollout.sessions.config import SessionServerConfig
from furlong.rollout.sessions.r3 import assemble_routed_experts, request_offset, use_addition_r3
from furlong.rollout.sessions.records import AbortedTurn, TurnRecord
from furlong.rollout.sessions.render import (
    PromptBudget,
    check_chatml,
    parse_tool_calls,
    render_prompt,
)
from furlong.rollout.sessions.state import Session, TurnPlan

log = logging.getLogger("furlong.sessions")


class SessionNotFound(LookupError):
    """HTTP 404."""


class TurnAborted(RuntimeError):
    """The engine aborted the turn (a weight publication under ``abort``, or an abort
    request): HTTP 503; nothing was committed, the agent retries the turn."""


class TooManySessions(RuntimeError):
    """HTTP 429."""


class SessionServer:
    """Over any :class:`~furlong.rollout.base.SessionEngine`: the embedded engine, an
    ``SGLangClient`` given the served model's tokenizer and context length, or any kind of
    the registry (``furlong.rollout.registry``) that provides the protocol."""

    def __init__(self, engine: SessionEngine, config: SessionServerConfig):
        self.engine, self.config = engine, config
        self.tokenizer = engine.tokenizer
        if self.tokenizer is None:
            raise InputError("engine.tokenizer: the session server renders chats; give one")
        check_chatml(self.tokenizer)
        if engine.context_length is None:
            raise InputError("engine.context_length: the session server must know the context")
        self.context = int(engine.context_length)
        self.budget = PromptBudget.of(self.tokenizer, self.context)
        # Derived once from the required pause mode; turns read only this flag.
        self.use_addition_r3 = use_addition_r3(config.pause_mode)
        self.replay = config.routing_replay and bool(engine.router.is_moe)
        if self.replay and not self.use_addition_r3:
            log.warning(
                "session server: pause mode 'retract' with routing replay returns full "
                "routed-expert rows on every turn (payloads grow with the trajectory)"
            )
        self.sessions: dict[str, Session] = {}

    # ---------------------------------------------------------------- sessions

    def open(self, return_sampling_mask: bool = False) -> Session:
        if not isinstance(return_sampling_mask, bool):
            raise InputError(f"return_sampling_mask: expected a bool, got {return_sampling_mask!r}")
        if len(self.sessions) >= self.config.max_sessions:
            raise TooManySessions(f"{len(self.sessions)} sessions are open (max_sessions)")
        session = Session(uuid.uuid4().hex, track_sampling_mask=return_sampling_mask)
        self.sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id!r}: not found")
        return session

    async def close(self, session_id: str) -> None:
        session = self.get(session_id)
        del self.sessions[session_id]
        session.closed = True
        if session.in_flight is not None:  # its turn will answer 404
            await asyncio.to_thread(self.engine.abort, [session.in_flight])

    # ---------------------------------------------------------------- turns

    async def chat(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """One OpenAI chat completion inside the session."""
        session = self.get(session_id)
        request = parse_chat_request(body, self.config.max_tokens)
        async with session.lock:  # a session's turns run one at a time
            if session.closed:
                raise SessionNotFound(f"session {session_id!r}: closed")
            lookup = session.assistant_tokens()
            prompt = render_prompt(
                self.tokenizer, request.messages, request.tools, lookup, self.budget
            )
            max_tokens = fit_max_tokens(
                request.max_tokens, len(prompt), self.context, self.config.max_tokens
            )
            plan = session.plan(prompt)
            start = self._routes_start(plan)
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                seed=request.seed,
                stop=request.stop,
                top_logprobs=request.top_logprobs if request.logprobs else 0,
                return_sampling_mask=session.track_sampling_mask,
                return_routed_experts=self.replay,
                routed_experts_start=start or 0,
            )
            rid = f"chatcmpl-{session.id}-{session.turns_started + 1}"
            future = self.engine.submit(prompt, params, request_id=rid)  # validates first
            session.turns_started += 1
            result = await self._wait(session, rid, future)
            if session.closed:
                raise SessionNotFound(f"session {session_id!r}: closed during the turn")
            if result.finish_reason == "abort":
                session.aborted.append(AbortedTurn(rid, "engine", len(result.output_ids)))
                raise TurnAborted(
                    f"session {session_id!r}: the turn was aborted by the engine (a weight "
                    f"update under pause mode {self.config.pause_mode!r}, or an abort request); "
                    "nothing was committed, retry it"
                )
            record = self._record(rid, plan, start, result, request)
            session.commit(plan, record)
        return completion_body(
            rid,
            self.config.model_name,
            record.message.to_json(),
            record.finish_reason,
            len(prompt),
            len(record.output_ids),
            self._logprobs(result) if request.logprobs else None,
        )

    def _routes_start(self, plan: TurnPlan) -> int | None:
        """The R3 offset to send: only with replay on and incremental R3 (else none)."""
        if not (self.replay and self.use_addition_r3):
            return None
        return request_offset(plan.checkpoint_len, plan.common_prefix)

    async def _wait(
        self, session: Session, rid: str, future: Future[GenerateResult]
    ) -> GenerateResult:
        session.in_flight = rid  # set before the first await: close() can abort it
        try:
            # shielded: cancelling the handler must not cancel the engine's own future
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:  # the client hung up (or the server is stopping)
            await asyncio.to_thread(self.engine.abort, [rid])
            done = future.done() and future.exception() is None
            made = len(future.result().output_ids) if done else None
            session.aborted.append(AbortedTurn(rid, "client_disconnected", made))
            raise
        finally:
            session.in_flight = None

    def _record(
        self,
        rid: str,
        plan: TurnPlan,
        start: int | None,
        result: GenerateResult,
        request: ChatRequest,
    ) -> TurnRecord:
        text = self.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        finish: str = result.finish_reason
        if finish == "stop" and request.stop:  # OpenAI leaves the stop string out
            cut = [text.find(s) for s in request.stop if s in text]
            text = text[: min(cut)] if cut else text
        calls: list = []
        if request.tools and request.parse_tool_calls and finish == "stop":
            text, calls = parse_tool_calls(text, lambda i: f"call_{rid[9:]}_{i}")
            finish = "tool_calls" if calls else finish
        rows = result.routed_experts
        return TurnRecord(
            request_id=rid,
            prompt_ids=list(plan.prompt),
            output_ids=list(result.output_ids),
            output_logprobs=list(result.output_logprobs),
            sampling_mask=result.sampling_mask,
            message=Message("assistant", text, tuple(calls)),
            finish_reason=finish,
            weight_version=result.weight_version,
            start_len=start,
            end=len(plan.prompt) + len(result.output_ids) - 1,
            routed_experts=None if rows is None or rows.shape[0] == 0 else rows,
        )

    def _logprobs(self, result: GenerateResult) -> dict[str, Any]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            return {"token": self.tokenizer.decode([token]), "logprob": logprob}

        top = result.top_logprobs or [[] for _ in result.output_ids]
        return {
            "content": [
                {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in alternatives]}
                for t, lp, alternatives in zip(
                    result.output_ids, result.output_logprobs, top, strict=True
                )
            ]
        }

    # ---------------------------------------------------------------- samples

    def sample(
        self, session_id: str, reward: float | None = None, max_length: int | None = None
    ) -> Sample:
        """The session's trajectory as one training ``Sample`` (tensors): tokens, loss mask
        (0 on tool/environment tokens), sampler log-probs, kept sets when tracked, and the
        assembled routed-expert rows when replay is on. ``max_length`` truncates the tail
        (its rows are cut with it). Read-only: the session is unchanged."""
        session = self.get(session_id)
        records, trajectory = session.committed
        if trajectory is None:
            raise InputError(f"session {session_id!r}: no committed turn to assemble")
        if reward is not None and (
            isinstance(reward, bool)
            or not isinstance(reward, int | float)
            or not math.isfinite(reward)
        ):
            raise InputError(f"reward: expected a finite number or null, got {reward!r}")
        if max_length is not None:
            if isinstance(max_length, bool) or not isinstance(max_length, int):
                raise InputError(f"max_length: expected an integer, got {max_length!r}")
            if max_length < trajectory.prompt_length:
                raise InputError(
                    f"max_length: {max_length} is shorter than the first prompt "
                    f"({trajectory.prompt_length} tokens)"
                )
            cut = max(0, trajectory.tokens.numel() - max_length)
            trajectory = truncate_response(trajectory, cut)
        rows = None
        if self.replay:
            n = trajectory.tokens.numel()
            rows = assemble_routed_experts(records, n, incremental=self.use_addition_r3)
        return trajectory.replace(
            reward=None if reward is None else float(reward), routed_experts=rows
        )

    # ---------------------------------------------------------------- weights

    def publish_weights(self, weights: Weights, version: int | None = None) -> int:
        """New weights for the engine; in-flight turns follow the configured pause mode
        (``abort``: they come back aborted and their agents get 503). The names and shapes
        are checked before the pause: a refused publication changes nothing and stops no
        turn."""
        if not isinstance(weights, Mapping):
            weights = ControlPolicy().load_weights(weights)
        self.engine.check_weights(weights)
        self.engine.pause(self.config.pause_mode)
        try:
            return self.engine.update_weights(weights, version)
        finally:
            self.engine.resume()
