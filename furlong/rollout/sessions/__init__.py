"""Agentic sessions: an OpenAI-compatible session server in front of the rollout engine, with
token-in/token-out trajectories and incremental routing replay (R3). See docs/sessions.md."""

from furlong.rollout.sessions.app import create_app
from furlong.rollout.sessions.config import SessionServerConfig
from furlong.rollout.sessions.r3 import AssemblyError, assemble_routed_experts, use_addition_r3
from furlong.rollout.sessions.records import TurnRecord
from furlong.rollout.sessions.service import (
    SessionNotFound,
    SessionServer,
    TooManySessions,
    TurnAborted,
)
from furlong.rollout.sessions.wire import sample_from_json, sample_to_json

__all__ = [
    "AssemblyError",
    "SessionNotFound",
    "SessionServer",
    "SessionServerConfig",
    "TooManySessions",
    "TurnAborted",
    "TurnRecord",
    "assemble_routed_experts",
    "create_app",
    "sample_from_json",
    "sample_to_json",
    "use_addition_r3",
]
