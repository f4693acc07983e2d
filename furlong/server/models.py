"""The model pool: every client's training model on the server's shared base models.

A LoRA model is one peft adapter on the single ``PeftModel`` of its base (the base weights are
in memory once, however many models train on it); a full fine-tune (behind ``full_finetune``)
is a private deep copy of the base. Each model has its own ``TrainingEngine`` over its own
parameters. Operations of models on one base are serialized by the base's lock and run with
that model's adapter activated; gradients of each adapter accumulate independently, because
peft's ``set_adapter`` only toggles ``requires_grad`` and inactive adapters take no part in a
pass.

Sampler snapshots (``save_sampler_weights``) are small for LoRA (adapter + config + base name);
``sampling_model`` turns one into a model for a rollout engine (for LoRA: the adapter applied on
the base's own weights).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import PreTrainedModel

from furlong.errors import InputError
from furlong.models.loading import atomic_dir, load_model, publish_dir
from furlong.train import lora as peft_lora
from furlong.train.checkpoint import safetensors_bytes
from furlong.train.engine import EngineConfig, TrainingEngine
from furlong.train.group import TrainerGroup
from furlong.train.lora import LoraSpec
from furlong.train.turns import around_turns
from furlong.types import AdamParams, Datum, ForwardResult

__all__ = ["LoraSpec", "ModelPool", "TrainingModel", "sampling_model", "snapshot_bytes"]

SNAPSHOT_FORMAT = "furlong-sampler-v1"
SNAPSHOT_META = "furlong_sampler.json"


@dataclass
class _Base:
    """One served base model; loaded on first use. ``lock`` serializes everything that runs or
    changes its shared PeftModel."""

    name: str
    spec: str
    dir_name: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    model: Any = None  # the plain HF model; never trained, never wrapped
    tokenizer: Any = None
    tokenizer_dir: Path | None = None
    peft: PeftModel | None = None  # wraps a weight-sharing view of ``model``
    adapters: set[str] = field(default_factory=set)


def _dir_names(names: Sequence[str]) -> dict[str, str]:
    """Path-safe, distinct directory names (no ':' or '/', no leading dot)."""
    out: dict[str, str] = {}
    for name in names:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "_"
        candidate, n = safe, 1
        while candidate in out.values():
            candidate, n = f"{safe}-{n}", n + 1
        out[name] = candidate
    return out


class ModelPool:
    """Served base models (loaded lazily, once) and the training models created on them."""

    def __init__(
        self,
        base_models: Mapping[str, str],
        *,
        full_finetune: bool = False,
        seed: int = 0,
        tokenizer_root: Path,
        dtype: torch.dtype = torch.float32,
        engine_config: EngineConfig | None = None,
        max_lora_rank: int = 512,
        trainer_ranks: int = 1,
    ):
        """``base_models``: served name -> preset name or local HF directory.
        ``trainer_ranks`` > 1: full fine-tunes train on a multi-rank TrainerGroup (FSDP2);
        LoRA models stay in this process, on the shared base."""
        if not base_models:
            raise ValueError("base_models: serve at least one base model")
        if not isinstance(trainer_ranks, int) or trainer_ranks < 1:
            raise InputError(f"trainer_ranks: must be an integer >= 1, got {trainer_ranks!r}")
        dirs = _dir_names(list(base_models))
        self._bases = {n: _Base(n, str(s), dirs[n]) for n, s in base_models.items()}
        self.full_finetune = full_finetune
        self.seed = seed
        self.tokenizer_root = Path(tokenizer_root)
        self.dtype = dtype
        self.engine_config = engine_config or EngineConfig()
        self.max_lora_rank = max_lora_rank
        self.trainer_ranks = trainer_ranks
        self._lock = threading.Lock()  # guards _models and _creating
        self._models: dict[str, TrainingModel] = {}
        self._creating: set[str] = set()

    def names(self) -> list[str]:
        return list(self._bases)

    def base(self, name: str) -> tuple[PreTrainedModel, Any]:
        """The shared base model and tokenizer, for base-model sampling. Read-only: every
        training model on this base shares its weights, so it must not be mutated."""
        base = self._loaded(name)
        return base.model, base.tokenizer

    def context_length(self, name: str) -> int | None:
        """The base's context (``max_position_embeddings``): prompt + samples must fit in it."""
        return getattr(self._loaded(name).model.config, "max_position_embeddings", None)

    def check_served(self, name: str) -> None:
        """An ``InputError`` naming ``base_model`` unless ``name`` is served (the wording
        docs/tinker-service.md quotes)."""
        if name not in self._bases:
            raise InputError(f"base_model: {name!r} is not served; served: {self.names()}")

    def tokenizer_dir(self, name: str) -> Path:
        """A directory ``AutoTokenizer.from_pretrained`` loads offline (no ':' in the path)."""
        tokenizer_dir = self._loaded(name).tokenizer_dir
        assert tokenizer_dir is not None
        return tokenizer_dir

    def create(
        self, model_id: str, base_model: str, lora: LoraSpec | None, optimizer: str = "adamw"
    ) -> TrainingModel:
        """A LoRA model, or with ``lora`` None (only when ``full_finetune``) a full fine-tune;
        ``optimizer``: the kind ("adamw" | "muon") on top of the pool's optimizer config."""
        base = self._lookup(base_model)
        config = replace(
            self.engine_config, optimizer=replace(self.engine_config.optimizer, kind=optimizer)
        )
        if lora is None and not self.full_finetune:
            raise InputError("lora_config: required (full fine-tuning is off on this server)")
        if lora is not None and lora.rank > self.max_lora_rank:
            raise InputError(
                f"lora_config.rank: {lora.rank} exceeds this server's maximum {self.max_lora_rank}"
            )
        with self._lock:
            if model_id in self._models or model_id in self._creating:
                raise InputError(f"model_id: {model_id!r} already exists")
            self._creating.add(model_id)
        try:
            if lora is None:
                model = self._create_full(model_id, base, config)
            else:
                model = self._create_lora(model_id, base, lora, config)
            with self._lock:
                self._models[model_id] = model
        finally:
            with self._lock:
                self._creating.discard(model_id)
        return model

    def get(self, model_id: str) -> TrainingModel:
        with self._lock:
            return self._models[model_id]  # KeyError: unknown

    def remove(self, model_id: str) -> None:
        with self._lock:
            model = self._models.pop(model_id)
        model._close()

    # ---------------------------------------------------------------- internals

    def _lookup(self, name: str) -> _Base:
        base = self._bases.get(name) if isinstance(name, str) else None
        if base is None:
            raise InputError(
                f"base_model: {name!r} is not served here; served: {', '.join(self._bases)}"
            )
        return base

    def _loaded(self, name: str) -> _Base:
        base = self._lookup(name)
        if base.model is None:  # once loaded, never waits for a training op holding the lock
            with base.lock:
                self._load(base)
        return base

    def _load(self, base: _Base) -> None:
        """Under ``base.lock``."""
        if base.model is not None:
            return
        model, tokenizer = load_model(base.spec, seed=self.seed, dtype=self.dtype)
        model.requires_grad_(False)
        model.to(self.engine_config.device).eval()  # type: ignore[arg-type]  # see RolloutActor
        tmp, final = atomic_dir(self.tokenizer_root / base.dir_name)
        try:
            tokenizer.save_pretrained(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        publish_dir(tmp, final)
        base.tokenizer, base.tokenizer_dir = tokenizer, final
        base.model = model  # last: ``_loaded`` reads it without the lock

    def _create_lora(
        self, model_id: str, base: _Base, spec: LoraSpec, engine_config: EngineConfig
    ) -> TrainingModel:
        with base.lock:
            self._load(base)
            config = peft_lora.peft_config(base.model, spec)
            name = peft_lora.adapter_name(model_id, base.adapters)
            seed = spec.seed
            if seed is None:
                seed = peft_lora.derive_seed(self.seed, model_id)
            base.peft = peft_lora.add_adapter(base.peft, base.model, name, config, seed)
            base.adapters.add(name)
            try:
                engine = TrainingEngine(
                    base.peft,
                    base.tokenizer,
                    engine_config,
                    trainable=peft_lora.adapter_params(base.peft, name),
                )
            except BaseException:
                _drop_adapter(base, name)
                raise
        return TrainingModel(model_id, base, engine, base.lock, adapter=name, spec=spec)

    def _create_full(self, model_id: str, base: _Base, config: EngineConfig) -> TrainingModel:
        if self.trainer_ranks > 1:  # the ranks load the same base (same seed) themselves
            with base.lock:
                self._load(base)
            dtype = str(self.dtype).removeprefix("torch.")
            group = TrainerGroup(base.spec, self.trainer_ranks, config, seed=self.seed, dtype=dtype)
            return TrainingModel(model_id, base, group, threading.Lock(), adapter=None, spec=None)
        with base.lock:
            self._load(base)
            model = copy.deepcopy(base.model)
        model.requires_grad_(True)
        engine = TrainingEngine(model, base.tokenizer, config)
        return TrainingModel(model_id, base, engine, threading.Lock(), adapter=None, spec=None)


def _drop_adapter(base: _Base, name: str) -> None:
    """Under ``base.lock``. The last adapter takes the PeftModel (and its view) with it."""
    base.adapters.discard(name)
    if not base.adapters:
        base.peft = None
    elif base.peft is not None:
        base.peft.set_adapter(next(iter(base.adapters)))  # peft warns when the active one goes
        base.peft.delete_adapter(name)


class TrainingModel:
    """One client's model. Thread-safe; every operation validates before it changes state."""

    def __init__(
        self,
        model_id: str,
        base: _Base,
        engine: TrainingEngine | TrainerGroup,
        lock: threading.Lock,
        *,
        adapter: str | None,
        spec: LoraSpec | None,
    ):
        self.model_id = model_id
        self.base_model = base.name
        self.engine = engine
        self.is_lora = spec is not None
        self.lora_rank = spec.rank if spec is not None else None
        self.lora = spec
        assert base.tokenizer_dir is not None
        self.tokenizer_dir = base.tokenizer_dir
        self._base = base
        self._lock = lock
        self._adapter = adapter
        self._removed = False

    @contextmanager
    def _active(self) -> Iterator[None]:
        """Hold the base's lock with this model's adapter active."""
        with self._lock:
            if self._removed:
                raise KeyError(self.model_id)
            if self._adapter is not None:
                self._peft().set_adapter(self._adapter)
            yield

    def _peft(self) -> PeftModel:
        """An adapter's peft model (the base's, which its TrainingEngine trains)."""
        assert isinstance(self.engine, TrainingEngine)  # _create_lora: one engine, in process
        model = self.engine.model
        assert isinstance(model, PeftModel)
        return model

    def lora_config(self) -> dict:
        return self.lora.as_dict() if self.lora is not None else {}

    def forward_backward(
        self,
        datums: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, object] | None,
        forward_only: bool,
    ) -> ForwardResult:
        # between microbatches another tenant's unit may run on this base: let go of the base
        # and take it back with our adapter active again (gradients stay on our parameters)
        with self._active(), around_turns(self._lock.release, self._resume):
            run = self.engine.forward if forward_only else self.engine.forward_backward
            return run(datums, loss_fn, loss_fn_config)

    def _resume(self) -> None:
        self._lock.acquire()
        if self._adapter is not None:
            self._peft().set_adapter(self._adapter)

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        with self._active():
            return self.engine.optim_step(adam)

    def _info(self) -> dict[str, Any]:
        return {"base_model": self.base_model, "lora": self.lora_config()}

    def save_state(self, path: Path) -> None:
        """Adapter (or full) weights + optimizer state, atomically."""
        with self._active():
            self.engine.save_state(path, info=self._info())

    def load_state(self, path: Path, optimizer: bool) -> None:
        """A checkpoint of another base, LoRA config or kind is refused before any change."""
        with self._active():
            self.engine.load_state(path, optimizer, expect_info=self._info())

    def save_sampler_weights(self, path: Path) -> None:
        """A weights snapshot for ``sampling_model``, atomically: for LoRA a peft adapter dir
        (adapter tensors + config, small), for a full fine-tune an HF model dir."""
        meta: dict[str, Any] = {
            "format": SNAPSHOT_FORMAT,
            "base_model": self.base_model,
            "model_id": self.model_id,
        }
        meta |= {"kind": "lora" if self.is_lora else "full", "lora": self.lora_config()}
        tmp, final = atomic_dir(path)
        try:
            with self._active():
                if self._adapter is not None:
                    peft_lora.save_adapter(tmp, self._peft(), self._adapter, self.base_model)
                else:  # HF model + tokenizer files (a rank group's rank 0 gathers the weights)
                    self.engine.export_hf(tmp)
            (tmp / SNAPSHOT_META).write_text(json.dumps(meta, indent=1))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        publish_dir(tmp, final)

    def _close(self) -> None:
        with self._lock:
            self._removed = True
            if self._adapter is not None:
                _drop_adapter(self._base, self._adapter)
            self.engine.close()


def _snapshot_meta(path: Path) -> dict:
    try:
        meta = json.loads((Path(path) / SNAPSHOT_META).read_text())
    except (OSError, ValueError):
        raise InputError(f"path: {path} is not a furlong sampler snapshot") from None
    if meta.get("format") != SNAPSHOT_FORMAT:
        raise InputError(f"path: {path} has format {meta.get('format')!r}")
    return meta


def sampling_model(pool: ModelPool, path: Path) -> tuple[PreTrainedModel, Any]:
    """``(model, tokenizer)``: a snapshot's weights for a rollout engine, independent of later
    training. A LoRA snapshot shares its base's weights and applies the adapter unmerged (it
    costs the adapter, never a base copy); a full fine-tune's is loaded whole. For the base
    model itself use ``pool.base(name)``."""
    meta = _snapshot_meta(path)
    if meta.get("kind") == "lora":
        base, tokenizer = pool.base(meta["base_model"])
        model = peft_lora.adapted_view(base, Path(path))
    else:
        model, tokenizer = load_model(path, dtype=pool.dtype)
        model.requires_grad_(False)
    model.to(pool.engine_config.device)  # type: ignore[arg-type]  # in place; see RolloutActor
    return model.eval(), tokenizer


def snapshot_bytes(pool: ModelPool, path: Path) -> int:
    """What ``sampling_model`` allocates for a snapshot (its adapter's or its model's tensors),
    read from the safetensors headers before anything is loaded."""
    meta = _snapshot_meta(path)
    if meta.get("kind") == "lora":
        return peft_lora.adapter_file_bytes(Path(path))
    return sum(safetensors_bytes(f) for f in sorted(Path(path).glob("*.safetensors")))
