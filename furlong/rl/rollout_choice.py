"""Which rollout engine the RL loop samples from (``[rollout] engine`` and ``urls``).

- ``embedded``: an in-process copy of the policy (the CPU default).
- ``sglang``: servers at ``rollout.urls`` speaking SGLang's HTTP protocol (``furlong
  rollout-server`` or real SGLang), behind one :class:`SGLangClient` that spreads requests
  over them and publishes weights to all of them.
- ``vllm``: vLLM servers, at ``rollout.urls`` or started from ``rollout.vllm_python``
  (:class:`~furlong.rollout.vllm_client.VLLMClient`), weights reloaded every step.
- ``ray``: engines as Ray actors are placed by ``[scale] ray``, not chosen here.

Whatever the kind, the engine returned holds the policy's weights as they are now (a remote
fleet is sent them here), so the loop treats every kind alike. The kinds themselves are the
registry's (``furlong.rollout.registry``); this module decides which one a run uses.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from furlong.errors import InputError
from furlong.rl.scale import ScaleOut
from furlong.rollout.base import RolloutEngine, check_url
from furlong.rollout.registry import ENGINES, EngineRequest, build_engine

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def check_choice(
    kind: object,
    urls: object,
    ray: str | None = None,
    vllm_python: str = "",
    vllm_transport: str = "disk",
) -> list[str]:
    """Validate ``rollout.engine`` / ``rollout.urls`` (``ray``: ``scale.ray``) and the vLLM
    kind's own fields without contacting anything; returns the normalized URLs. Safe to call
    from config validation."""
    if not isinstance(kind, str) or kind not in ENGINES:
        raise InputError(f"rollout.engine: {kind!r} is not one of {list(ENGINES)}")
    if kind == "ray" and ray is None:
        raise InputError(
            'rollout.engine: "ray" runs the engines as Ray actors placed by [scale]: set '
            'scale.ray = "local" (or a cluster address) and scale.rollout_engines'
        )
    if isinstance(urls, str) or not isinstance(urls, Sequence):
        raise InputError(f"rollout.urls: expected a list of URLs, got {urls!r}")
    if kind not in ("sglang", "vllm") and urls:
        raise InputError('rollout.urls: only used with rollout.engine = "sglang" or "vllm"')
    if kind != "vllm" and vllm_python:
        raise InputError('rollout.vllm_python: only used with rollout.engine = "vllm"')
    if kind == "vllm":
        from furlong.rollout.vllm_client import check_options

        check_options(list(urls), vllm_python, vllm_transport)
    if kind == "sglang" and not urls:
        raise InputError('rollout.urls: rollout.engine = "sglang" needs at least one server URL')
    checked = [check_url(u, f"rollout.urls[{i}]") for i, u in enumerate(urls)]
    for i, url in enumerate(checked):
        if url in checked[:i]:
            raise InputError(f"rollout.urls[{i}]: {url} is listed twice")
    return checked


def rollout_kind(engine: str, scale: ScaleOut) -> str:
    """The one place the loop's rollout kind is decided: ``rollout.engine``, except that with
    Ray (``scale.ray``) the engines are Ray actors placed beside the trainer ranks."""
    return "ray" if scale.ray is not None else engine


def build_rollout(
    kind: str,
    urls: Sequence[str],
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    batch: int,
    *,
    staging_dir: str | os.PathLike | None = None,
    timeout: float = 600.0,
    ray: Mapping[str, Any] | None = None,
    vllm: Mapping[str, Any] | None = None,
) -> RolloutEngine:
    """The loop's rollout engine from the registry (``furlong.rollout.registry``), holding
    ``policy``'s current weights at version 0 in a copy of its own.

    ``batch``: requests the loop sends at once (the embedded engine's slots; for servers,
    requests in flight). ``staging_dir``: a directory the servers can read, through which
    weights are published (required by real SGLang; furlong's server also takes HTTP
    buckets). The servers' admin token (weights, pausing, memory) is ``$FURLONG_ADMIN_TOKEN``:
    a secret, so not in the config. ``ray``: the engines' placement (``scale_out.build``).
    ``vllm``: the vLLM kind's ``vllm_python``, ``vllm_transport`` and ``vllm_threads``.
    Errors name the config field: ``rollout.engine``, ``rollout.urls[i]``,
    ``rollout.staging_dir``."""
    v = dict(vllm or {})
    ray_at = "local" if ray is not None else None
    checked = check_choice(
        kind, urls, ray_at, str(v.get("vllm_python", "")), str(v.get("vllm_transport", "disk"))
    )
    options = {"urls": checked, "staging_dir": staging_dir, "timeout": timeout, **(ray or {}), **v}
    request = EngineRequest(policy, tokenizer, max_running=batch, private=True, options=options)
    return build_engine(kind, request, RolloutEngine)
