"""What one API key and its sessions may hold in memory: the bounds `furlong serve` takes as
flags and :class:`~furlong.server.config.ServiceConfig` as fields, declared once here. Nothing
heavy is imported, so the CLI's help shows their defaults without loading torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bound:
    kind: type  # int or float: the flag's type
    default: Any  # of ``kind``
    least: float  # the smallest value accepted
    help: str


BOUNDS: dict[str, Bound] = {
    "max_models_per_key": Bound(
        int, 16, 0, "training models one API key may hold loaded (0: no limit)"
    ),
    "session_timeout": Bound(
        float,
        120.0,
        0,
        "seconds of silence (no heartbeat; the SDK beats every 10 s) that end "
        "a session and free its models (0: never)",
    ),
    "snapshot_engines": Bound(
        int, 8, 1, "sampler snapshot engines kept loaded (least recently used go)"
    ),
    "sampler_memory_mb": Bound(
        int, 4096, 1, "MB of snapshot weights they may hold (a LoRA's: its adapter)"
    ),
    "sampler_idle_s": Bound(
        float, 600.0, 0, "seconds unused after which a snapshot engine goes (0: never)"
    ),
}
