"""Rollout engine kinds, in one table that every front door asks: the RL loop
(``rollout.engine``), the session server (``--engine``) and the Tinker service
(``--rollout-engine``).

A kind is a class with a ``from_request(request)`` constructor, named as ``"module:Class"`` and
imported only when first asked for (Ray and httpx stay unimported by runs that do not use
them). A front door names the protocol it needs (``furlong.rollout.base``); a kind whose class
lacks one of its members is refused before anything is built, naming the members. Adding a
kind is one file with the class and one line in ``ENGINES`` (or :func:`register_engine`)."""

from __future__ import annotations

import copy
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from furlong.errors import InputError
from furlong.extras import extra_of, install_hint
from furlong.rollout.base import protocol_members

if TYPE_CHECKING:
    from transformers import PreTrainedModel

E = TypeVar("E")

ENGINES: dict[str, str | type] = {
    "embedded": "furlong.rollout.engine:EmbeddedEngine",
    "sglang": "furlong.rollout.sglang_client:SGLangClient",
    "vllm": "furlong.rollout.vllm_client:VLLMClient",
    "ray": "furlong.rl.ray_rollout:RayRollout",
}


@dataclass(frozen=True)
class EngineRequest:
    """What a front door knows when it asks for an engine."""

    model: PreTrainedModel  # the weights the engine starts from (it serves them, or sends them)
    tokenizer: Any
    max_running: int = 32  # requests at once (the embedded engine's slots)
    private: bool = False  # True: never share the model's tensors (the caller trains them)
    # the kind's own settings, each named as its config field: urls, staging_dir, timeout, ...
    options: Mapping[str, Any] = field(default_factory=dict)

    def model_to_serve(self) -> PreTrainedModel:
        """The model an in-process engine runs: a copy when the caller trains its own."""
        return copy.deepcopy(self.model) if self.private else self.model


def register_engine(kind: str, engine: str | type) -> None:
    """Add a kind (a class with ``from_request``, or its ``"module:Class"``)."""
    if kind in ENGINES:
        raise InputError(f"engine kind {kind!r}: already registered")
    ENGINES[kind] = engine


def engine_class(kind: object, need: type, where: str = "rollout.engine") -> type[Any]:
    """The class of ``kind``, checked against the protocol ``need`` (``where``: the config
    field or flag that named the kind, for errors)."""
    if not isinstance(kind, str) or kind not in ENGINES:
        raise InputError(f"{where}: {kind!r} is not one of {sorted(ENGINES)}")
    entry = ENGINES[kind]
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(module), name)
        except ImportError as e:  # an optional dependency (ray) is missing
            top = (e.name or "").partition(".")[0]
            extra = extra_of(top)
            hint = f": {install_hint(extra)}" if extra else ""
            raise InputError(f"{where}: {kind!r} needs {top}, which is not installed{hint}") from e
    cls = cast(type[Any], entry)
    missing = [m for m in protocol_members(need) if not _declares(cls, m)]
    if not hasattr(cls, "from_request"):
        missing.append("from_request")
    if missing:
        raise InputError(
            f"{where}: {kind!r} cannot serve here: {cls.__name__} lacks {missing} ({need.__name__})"
        )
    return cls


def build_engine(
    kind: object, request: EngineRequest, need: type[E], where: str = "rollout.engine"
) -> E:
    """An engine of ``kind`` for ``request`` that provides ``need``."""
    return cast(E, engine_class(kind, need, where).from_request(request))


def _declares(cls: type, member: str) -> bool:
    """A method or property of ``cls``, or an attribute it annotates (set per instance)."""
    return hasattr(cls, member) or any(
        member in vars(c).get("__annotations__", {}) for c in cls.__mro__
    )
