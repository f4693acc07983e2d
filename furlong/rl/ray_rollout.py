"""Rollout engines as Ray actors, behind the RolloutEngine interface the loop uses.

Each engine is an :class:`~furlong.rollout.engine.EmbeddedEngine` in an actor that Ray restarts
when its process dies. :class:`RayRollout` splits a generate call across the engines (results
in request order) and remembers the last published weights (an object ref): when an engine
dies mid-call, it waits for the restart, publishes those weights and version again, and
retries the call, so no request is served by stale weights.

Generation results come back as one rollout-codec payload per engine call, not as pickled
objects, so the codec's allowlist governs what travels: the default fields, plus the optional
ones (sampling masks, routed experts) the driver opts in to, by default what the call's
``SamplingParams`` ask for. An engine sends every optional field its results carry, and the
driver's strict decode refuses one it did not opt in to.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
import torch
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from furlong.errors import InputError
from furlong.models.loading import load_model
from furlong.rollout.base import (
    GenerateResult,
    MemoryBytes,
    MemoryTag,
    PauseMode,
    RolloutEngine,
    Weights,
    check_weight_shapes,
    expand_params,
    no_memory,
)
from furlong.rollout.codec import decode_results, encode_results, opt_in, payload_fields
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.registry import EngineRequest
from furlong.rollout.sampling import SamplingParams

# A Ray actor handle (of a RolloutActor). Ray types method access on an ActorHandle as Never,
# and ActorClass.remote() as ActorHandle[T] | type[T]: typed calls would need @ray.method on
# every actor method. The handles are Any; what they run is RolloutActor.call.
Actor = Any

CALLS = frozenset(
    {
        "generate",
        "update_weights",
        "weight_shapes",
        "pause",
        "resume",
        "abort",
        "offload",
        "onload",
        "memory_bytes",
    }
)


@dataclass(frozen=True)
class EngineSpec:
    """What every engine actor loads: a preset (with its seed) or an HF directory."""

    model: str
    seed: int = 0
    max_running: int = 16  # batch slots
    dtype: str = "float32"
    device: str = "cpu"  # "cuda": the actor's GPU (Ray sets CUDA_VISIBLE_DEVICES)
    threads: int = 1  # CPU intra-op threads


class RolloutActor:
    """One embedded engine in a Ray actor."""

    def __init__(self, spec: EngineSpec):
        torch.set_num_threads(spec.threads)
        policy, tokenizer = load_model(spec.model, seed=spec.seed, dtype=getattr(torch, spec.dtype))
        # in place (Module.to returns self). transformers wraps PreTrainedModel.to with
        # functools.wraps(nn.Module.to), which typeshed types as the unbound function: self first
        policy.to(spec.device)  # type: ignore[arg-type]
        self.engine = EmbeddedEngine(policy, tokenizer, max_running=spec.max_running)

    def ready(self) -> int:
        return self.engine.weight_version

    def call(self, method: str, *args: Any) -> Any:
        if method not in CALLS:
            raise ValueError(f"method: {method!r} is not one of {sorted(CALLS)}")
        if method == "generate":
            return self.generate(*args)
        return getattr(self.engine, method)(*args)

    def generate(
        self, prompts: list[list[int]], params: list[SamplingParams], fields: Sequence[str]
    ) -> bytes:
        """The results as a codec payload: the driver's ``fields`` and all the results carry."""
        results = self.engine.generate(prompts, params)
        return encode_results(results, payload_fields(results, fields))


def requested_fields(params: Sequence[SamplingParams]) -> tuple[str, ...]:
    """The codec allowlist that carries what ``params`` ask the engine to return."""
    optional = [
        *(["sampling_mask"] if any(p.return_sampling_mask for p in params) else []),
        *(["routed_experts"] if any(p.return_routed_experts for p in params) else []),
    ]
    return opt_in(*optional)


class RayRollout:
    """The engines of a run; ``restarts`` counts recoveries. ``fields``: the codec allowlist
    results travel under (None: per call, what its ``SamplingParams`` ask for)."""

    def __init__(
        self,
        engines: Sequence[Actor],
        attempts: int = 3,
        restart_timeout_s: float = 600,
        fields: Sequence[str] | None = None,
    ):
        self.engines = list(engines)
        self.fields = None if fields is None else opt_in(*fields)
        self.attempts = attempts
        self.restart_timeout_s = restart_timeout_s
        self.restarts = 0
        self._shapes: dict[str, tuple[int, ...]] | None = None  # served parameters, once asked
        self._weights: ray.ObjectRef | None = None  # the last publication, for restarted engines
        self._version = 0
        ray.get([e.ready.remote() for e in self.engines])

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerateResult]:
        """Contiguous slices of the prompts, one per engine, all in flight at once."""
        plist = expand_params(len(prompts), params)
        fields = requested_fields(plist) if self.fields is None else self.fields
        n, k = len(prompts), len(self.engines)
        bounds = [(j * n // k, (j + 1) * n // k) for j in range(k)]
        args = [([list(p) for p in prompts[a:b]], plist[a:b], fields) for a, b in bounds]
        refs = [
            e.call.remote("generate", *a) if a[0] else None
            for e, a in zip(self.engines, args, strict=True)
        ]
        results: list[GenerateResult] = []
        for j, ref in enumerate(refs):
            if ref is not None:
                results += decode_results(self._get(j, ref, "generate", *args[j]), fields)
        return results

    def update_weights(self, weights: Weights | ray.ObjectRef, version: int | None = None) -> int:
        """Every engine takes the weights (put in the object store once, read by each)."""
        ref = weights if isinstance(weights, ray.ObjectRef) else ray.put(weights)
        version = self._version + 1 if version is None else int(version)
        self._weights, self._version = ref, version
        self._all("update_weights", ref, version)
        return version

    @classmethod
    def from_request(cls, request: EngineRequest) -> RayRollout:
        """The registry's ``ray`` kind: engine actors placed by ``scale_out.build``, whose
        options (``engine``, ``strategies``, ``resources``) the request carries. Each actor
        loads the policy's weights source itself (``request.model`` is not sent)."""
        options = request.options
        if "engine" not in options:
            raise InputError(
                'rollout.engine: "ray" runs the engines as Ray actors placed by [scale]: set '
                'scale.ray = "local" (or a cluster address) and scale.rollout_engines'
            )
        engines = start_engines(options["engine"], options["strategies"], options["resources"])
        return cls(engines)

    def check_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Against the served names and shapes (every engine serves the same model: asked of
        the first, once)."""
        if self._shapes is None:
            ref = self.engines[0].call.remote("weight_shapes")
            self._shapes = self._get(0, ref, "weight_shapes")
        check_weight_shapes(weights, self._shapes)

    def pause(self, mode: PauseMode = "retract") -> None:
        self._all("pause", mode)

    def resume(self) -> None:
        self._all("resume")

    def abort(self, request_ids: Iterable[int | str] | None = None) -> int:
        ids = None if request_ids is None else list(request_ids)
        return sum(self._all("abort", ids))

    def offload(self, tags: Iterable[MemoryTag]) -> None:
        self._all("offload", list(tags))

    def onload(self, tags: Iterable[MemoryTag]) -> None:
        self._all("onload", list(tags))

    def memory_bytes(self) -> MemoryBytes:
        """Summed over the engines."""
        total = no_memory()
        for sizes in self._all("memory_bytes"):
            for k, v in sizes.items():
                total[k] += v
        return total

    def metrics(self) -> dict[str, float]:
        return {"rollout_restarts:max": float(self.restarts)}

    def close(self) -> None:
        for engine in self.engines:
            ray.kill(engine, no_restart=True)
        self.engines = []

    # ---------------------------------------------------------------- recovery

    def _all(self, method: str, *args: Any) -> list[Any]:
        refs = [e.call.remote(method, *args) for e in self.engines]
        return [self._get(j, ref, method, *args) for j, ref in enumerate(refs)]

    def _get(self, j: int, ref: ray.ObjectRef, method: str, *args: Any) -> Any:
        for attempt in range(self.attempts):
            try:
                return ray.get(ref)
            except RayActorError:
                if attempt == self.attempts - 1:
                    raise
                self._recover(j)
                ref = self.engines[j].call.remote(method, *args)
        raise AssertionError("unreachable")

    def _recover(self, j: int) -> None:
        """Wait for Ray to restart engine ``j``, then publish the last weights to it."""
        self.restarts += 1
        engine = self.engines[j]
        deadline = time.monotonic() + self.restart_timeout_s
        while True:
            try:
                ray.get(engine.ready.remote())
                break
            except RayActorError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        if self._weights is not None:
            ray.get(engine.call.remote("update_weights", self._weights, self._version))


def start_engines(
    spec: EngineSpec,
    strategies: Sequence[PlacementGroupSchedulingStrategy | None],
    resources: Sequence[dict[str, float]],
) -> list[Actor]:
    """One restartable engine actor per scheduling strategy (placement-group bundle)."""
    actor = ray.remote(RolloutActor)
    job = ray.get_runtime_context().get_job_id()
    return [
        actor.options(
            num_cpus=need.get("CPU", 0),
            num_gpus=need.get("GPU", 0),
            scheduling_strategy=where,
            max_restarts=-1,  # Ray restarts a dead engine; RayRollout re-publishes the weights
            max_task_retries=0,  # a call in flight fails, and RayRollout retries it
            name=f"furlong-rollout-{job}-{j}",
        ).remote(spec)
        for j, (where, need) in enumerate(zip(strategies, resources, strict=True))
    ]


if TYPE_CHECKING:
    # mypy holds the kind to each protocol it serves, signatures included (the registry's
    # run-time check reads only the names); one function per protocol, so that an error names
    # the missing or mismatched member

    def _rollout(engine: RayRollout) -> RolloutEngine:
        return engine
