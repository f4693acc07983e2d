"""The settings of ``furlong serve``: one flat :class:`ServiceConfig` (what the CLI and tests
build) and the narrow views its parts are given, each declared beside what it configures
(:class:`TrainingConfig` in training.py, :class:`SamplingConfig` in sampling.py), so no part
depends on service.py or on settings it does not read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from furlong.errors import InputError
from furlong.precision import resolve_dtype
from furlong.rollout.base import SamplingEngine
from furlong.rollout.registry import engine_class
from furlong.server.bounds import BOUNDS
from furlong.server.sample_request import SampleCaps
from furlong.server.sampling import SamplingConfig
from furlong.server.training import TrainingConfig
from furlong.train.engine import EngineConfig
from furlong.train.optim import OptimizerConfig


@dataclass(frozen=True)
class ServiceConfig:
    base_models: dict[str, str]  # served name -> preset or local HF dir
    state_dir: Path
    full_finetune: bool = False
    seed: int = 0
    max_datums: int = 4096
    max_tokens_per_datum: int = 32_768
    max_tensor_elements: int = 1 << 22  # one loss_fn_inputs tensor, once dense
    max_request_elements: int = 1 << 26  # all tensors of one forward_backward, once dense
    max_samples: int = 1024  # num_samples of one sample request
    max_sample_tokens: int = 4096  # max_tokens of one sample request (also <= the context)
    max_top_logprobs: int = 64  # topk_sample_logprobs / topk_prompt_logprobs
    poll_timeout: float = 25.0
    gap_timeout: float = 600.0
    max_seq_ahead: int = 1 << 14  # a seq_id further ahead of the next one is refused
    sampler_slots: int = 32
    # the memory bounds (bounds.py says what each means)
    snapshot_engines: int = BOUNDS["snapshot_engines"].default
    sampler_memory_mb: int = BOUNDS["sampler_memory_mb"].default
    sampler_idle_s: float = BOUNDS["sampler_idle_s"].default
    session_timeout: float = BOUNDS["session_timeout"].default
    max_models_per_key: int = BOUNDS["max_models_per_key"].default
    compress_fwdbwd: bool = False  # ask clients to zstd forward_backward bodies
    fwdbwd_max_chunk_len: int = 1024  # datums per forward_backward request (client-side split)
    trainer_ranks: int = 1  # > 1: full fine-tunes train on that many FSDP2 ranks (LoRA: 1)
    dtype: str = "float32"  # the base models' precision: float32 | bfloat16 | auto (precision.py)
    optimizer_state_dir: str | None = None  # every model's optimizer state on disk there
    jwt_auth: bool = False  # clients exchange their key for a short-lived JWT (auth/token)
    ttl_sweep_interval: float = 60.0  # seconds between sweeps deleting expired checkpoints
    clock: Callable[[], float] = time.time  # wall time for checkpoint TTLs, URLs and JWTs
    rollout_engine: str = "embedded"  # the samplers' engine kind (furlong.rollout.registry)
    # the kind's options, named as the RL config's rollout.* fields: urls, vllm_python, ...
    rollout_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, bound in BOUNDS.items():
            if not getattr(self, name) >= bound.least:
                raise InputError(f"{name}: must be >= {bound.least:g}, got {getattr(self, name)!r}")
        engine_class(self.rollout_engine, SamplingEngine, "rollout_engine")  # before any load
        if self.rollout_engine == "vllm":
            from furlong.rollout.vllm_client import check_options

            o = self.rollout_options
            check_options(o.get("urls") or [], o.get("vllm_python") or "", "disk", flags=True)
        resolve_dtype(self.dtype)

    def training(self) -> TrainingConfig:
        return TrainingConfig(
            full_finetune=self.full_finetune,
            max_models_per_key=self.max_models_per_key,
            gap_timeout=self.gap_timeout,
            max_seq_ahead=self.max_seq_ahead,
        )

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(
            caps=SampleCaps(self.max_samples, self.max_sample_tokens, self.max_top_logprobs),
            sampler_slots=self.sampler_slots,
            snapshot_engines=self.snapshot_engines,
            sampler_memory_mb=self.sampler_memory_mb,
            sampler_idle_s=self.sampler_idle_s,
            engine=self.rollout_engine,
            engine_options=dict(self.rollout_options),
        )

    def engine(self) -> EngineConfig:
        """The pool's engine settings: optimizer state in file-backed mappings on request."""
        if self.optimizer_state_dir is None:
            return EngineConfig()
        store = OptimizerConfig(state_store="disk", disk_dir=self.optimizer_state_dir)
        return EngineConfig(optimizer=store)
