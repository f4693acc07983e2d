"""A rollout engine kind made the way docs/rollout.md says: one file with a class that has
``from_request``, and one registry line (``register_engine("recording", RecordingEngine)``).
It is the embedded engine that also keeps every prompt it was asked to continue, so a test
can see that a front door really used it."""

from __future__ import annotations

from collections.abc import Sequence

from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.registry import ENGINES, EngineRequest, register_engine


class RecordingEngine(EmbeddedEngine):
    built: list[RecordingEngine] = []  # every engine a front door asked for, in order

    @classmethod
    def from_request(cls, request: EngineRequest) -> RecordingEngine:
        engine = cls(request.model_to_serve(), request.tokenizer, max_running=request.max_running)
        cls.built.append(engine)
        return engine

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompts: list[list[int]] = []

    def submit_many(self, prompts: Sequence[Sequence[int]], *rest, **named):  # type: ignore[override]
        futures = super().submit_many(prompts, *rest, **named)
        self.prompts.extend(list(p) for p in prompts)  # only what the engine accepted
        return futures


def registered() -> type[RecordingEngine]:
    """Register the kind once per process (tests in one session share the registry)."""
    if "recording" not in ENGINES:
        register_engine("recording", RecordingEngine)
    return RecordingEngine
