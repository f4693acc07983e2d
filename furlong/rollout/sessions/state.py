"""A session's state: the token checkpoint, the trajectory as one ``Sample``, and the records.

The checkpoint is the token ids of the last committed turn (its prompt + output). A new turn's
prompt is compared with it: the turn extends the latest committed snapshot (a record boundary)
that is a prefix of the prompt, which is found from their longest common prefix. When that is
not the last record (a retry, or a different tool result), the later records are dropped: the
checkpoint rolls back. Nothing changes until a turn commits, so an aborted turn leaves the
session exactly as it was.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from furlong.rollout.sample import Sample, append_forced, append_sampled, truncate_response
from furlong.rollout.sessions.chat import Message
from furlong.rollout.sessions.records import AbortedTurn, TurnRecord


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass(frozen=True)
class TurnPlan:
    prompt: list[int]
    base: int  # records kept: the turn extends records[:base]
    checkpoint_len: int  # tokens of that snapshot (0 when base == 0)
    common_prefix: int  # longest common prefix of the current checkpoint and the prompt


@dataclass
class Session:
    id: str
    track_sampling_mask: bool = False  # kept sets per position (tool tokens: singletons)
    # (records, trajectory), swapped whole on commit so that a reader in another thread
    # always sees a consistent pair; the trajectory's tokens are the checkpoint
    committed: tuple[list[TurnRecord], Sample | None] = field(default_factory=lambda: ([], None))
    turns_started: int = 0
    aborted: list[AbortedTurn] = field(default_factory=list)  # turns that never committed
    closed: bool = False
    in_flight: str | None = None  # the engine request id of the running turn
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def records(self) -> list[TurnRecord]:
        return self.committed[0]

    @property
    def trajectory(self) -> Sample | None:
        return self.committed[1]

    @property
    def tokens(self) -> list[int]:
        """The checkpoint: every token of the trajectory so far."""
        return [] if self.trajectory is None else self.trajectory.tokens.tolist()

    def assistant_tokens(self):
        """A lookup for the renderer: the i-th returned message found in a request maps to the
        first matching record after the previous match, so repeated texts keep their order."""
        keys = [r.message.key() for r in self.records]
        position = 0

        def lookup(message: Message) -> list[int] | None:
            nonlocal position
            key = message.key()
            for i in range(position, len(keys)):
                if keys[i] == key:
                    position = i + 1
                    return self.records[i].output_ids
            return None

        return lookup

    def plan(self, prompt: list[int]) -> TurnPlan:
        shared = common_prefix(self.tokens, prompt)
        base = 0
        for i, record in enumerate(self.records):  # checkpoint lengths grow along the chain
            if record.checkpoint_len <= shared:
                base = i + 1
        checkpoint_len = self.records[base - 1].checkpoint_len if base else 0
        return TurnPlan(prompt, base, checkpoint_len, shared)

    def commit(self, plan: TurnPlan, record: TurnRecord) -> None:
        """Roll back to the plan's snapshot, append the new tokens (observation: loss mask 0,
        the model's output: its log-probs) and the record. All-or-nothing: the new trajectory
        is built before anything is assigned."""
        if plan.base == 0:
            trajectory = Sample.from_prompt(plan.prompt)
        else:
            assert self.trajectory is not None
            dropped = self.trajectory.tokens.numel() - plan.checkpoint_len
            trajectory = truncate_response(self.trajectory, dropped)
            trajectory = append_forced(trajectory, plan.prompt[plan.checkpoint_len :])
        trajectory = append_sampled(
            trajectory, record.output_ids, record.output_logprobs, record.sampling_mask
        ).replace(weight_version=record.weight_version)
        self.committed = ([*self.records[: plan.base], record], trajectory)
