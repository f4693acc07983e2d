"""One record per committed turn: what was asked, what came back, and its routed-expert patch;
and a note of each turn that ended without being committed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from furlong.rollout.sampling_mask import SamplingMask
from furlong.rollout.sessions.chat import Message


@dataclass(frozen=True)
class TurnRecord:
    request_id: str  # the completion id, also the engine's request id
    prompt_ids: list[int]  # the request's ids: the rendered prompt the engine continued
    output_ids: list[int]
    output_logprobs: list[float]
    sampling_mask: SamplingMask | None
    message: Message  # the assistant message returned to the agent
    finish_reason: str  # as returned to the agent (stop / length / tool_calls)
    weight_version: int
    # R3: the offset sent with the request (None: none was sent, rows start at 0), where this
    # record's rows end (len(prompt) + len(output) - 1), and the rows [start_len, end).
    start_len: int | None
    end: int
    routed_experts: torch.Tensor | None

    @property
    def checkpoint_len(self) -> int:
        """Length of the session's token checkpoint once this turn is committed."""
        return len(self.prompt_ids) + len(self.output_ids)

    def summary(self, index: int) -> dict[str, Any]:
        rows = self.routed_experts
        return {
            "index": index,
            "request_id": self.request_id,
            "prompt_ids": self.prompt_ids,
            "output_ids": self.output_ids,
            "message": self.message.to_json(),
            "finish_reason": self.finish_reason,
            "weight_version": self.weight_version,
            "start_len": self.start_len,
            "end": self.end,
            "routed_rows": 0 if rows is None else int(rows.shape[0]),
        }


# engine: the engine ended it (a weight update under pause mode "abort", or an abort request);
# client_disconnected: the agent hung up before the reply, so the engine was told to stop
AbortReason = Literal["engine", "client_disconnected"]


@dataclass(frozen=True)
class AbortedTurn:
    """A turn that was started and never committed: nothing of it is in the trajectory."""

    request_id: str
    reason: AbortReason
    output_tokens: int | None  # generated before it stopped (None: not known)

    def summary(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "reason": self.reason,
            "output_tokens": self.output_tokens,
        }
