"""Session-server configuration, validated at construction (before anything is served)."""

from __future__ import annotations

from dataclasses import dataclass

from furlong.errors import InputError
from furlong.rollout.base import PauseMode, check_pause_mode


@dataclass(frozen=True)
class SessionServerConfig:
    # Required: what a weight publication does to in-flight turns, and from it whether routed
    # experts can be requested incrementally (see furlong.rollout.sessions.r3).
    pause_mode: PauseMode
    routing_replay: bool = True  # MoE models: record routed experts for the trainer (R3)
    # Rejected when True: resuming an aborted turn outside the record chain would produce rows
    # and log-probs for a turn that was never committed (and mix weight versions in one turn).
    partial_rollout: bool = False
    max_sessions: int = 4096  # open sessions at once; more get HTTP 429
    max_tokens: int = 4096  # upper bound on one turn's max_tokens
    model_name: str = "furlong"  # echoed as the completion's "model"

    def __post_init__(self) -> None:
        check_pause_mode(self.pause_mode)
        if self.partial_rollout:
            raise InputError(
                "partial_rollout: not supported by the session server (a resumed partial turn "
                "would produce routed-expert rows and log-probs for a turn never committed)"
            )
        for name in ("max_sessions", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name}: expected an integer >= 1, got {value!r}")
        if not isinstance(self.routing_replay, bool):
            raise InputError(f"routing_replay: expected a bool, got {self.routing_replay!r}")
