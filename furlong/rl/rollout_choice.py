"""Which rollout engine the RL loop samples from (``[rollout] engine`` and ``urls``).

- ``embedded``: an in-process copy of the policy (the CPU default).
- ``sglang``: servers at ``rollout.urls`` speaking SGLang's HTTP protocol (``furlong
  rollout-server`` or real SGLang), behind one :class:`SGLangClient` that spreads requests
  over them and publishes weights to all of them.
- ``ray``: engines as Ray actors are placed by ``[scale] ray``, not chosen here.

Whatever the kind, the engine returned holds the policy's weights as they are now (a remote
fleet is sent them here), so the loop treats every kind alike.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from furlong.errors import InputError
from furlong.models.moe import find_routers
from furlong.rollout.base import RolloutEngine, check_url
from furlong.rollout.engine import EmbeddedEngine

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from furlong.rollout.sglang_client import SGLangClient

ENGINES = ("embedded", "sglang", "ray")


def check_choice(kind: object, urls: object, ray: str | None = None) -> list[str]:
    """Validate ``rollout.engine`` / ``rollout.urls`` (``ray``: ``scale.ray``) without
    contacting anything; returns the normalized URLs. Safe to call from config validation."""
    if kind not in ENGINES:
        raise InputError(f"rollout.engine: {kind!r} is not one of {list(ENGINES)}")
    if kind == "ray" and ray is None:
        raise InputError(
            'rollout.engine: "ray" runs the engines as Ray actors placed by [scale]: set '
            'scale.ray = "local" (or a cluster address) and scale.rollout_engines'
        )
    if isinstance(urls, str) or not isinstance(urls, Sequence):
        raise InputError(f"rollout.urls: expected a list of URLs, got {urls!r}")
    if kind != "sglang" and urls:
        raise InputError('rollout.urls: only used with rollout.engine = "sglang"')
    if kind == "sglang" and not urls:
        raise InputError('rollout.urls: rollout.engine = "sglang" needs at least one server URL')
    checked = [check_url(u, f"rollout.urls[{i}]") for i, u in enumerate(urls)]
    for i, url in enumerate(checked):
        if url in checked[:i]:
            raise InputError(f"rollout.urls[{i}]: {url} is listed twice")
    return checked


def build_rollout(
    kind: str,
    urls: Sequence[str],
    policy: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    batch: int,
    *,
    staging_dir: str | os.PathLike | None = None,
    timeout: float = 600.0,
) -> RolloutEngine:
    """The loop's rollout engine, holding ``policy``'s current weights at version 0.

    ``batch``: requests the loop sends at once (the embedded engine's slots; for servers,
    requests in flight). ``staging_dir``: a directory the servers can read, through which
    weights are published (required by real SGLang; furlong's server also takes HTTP
    buckets). The servers' admin token (weights, pausing, memory) is ``$FURLONG_ADMIN_TOKEN``:
    a secret, so not in the config. Errors name the config field: ``rollout.engine``,
    ``rollout.urls[i]``, ``rollout.staging_dir``."""
    checked = check_choice(kind, urls)  # "ray" (no scale.ray here) is refused
    if kind == "embedded":
        return EmbeddedEngine(copy.deepcopy(policy), tokenizer, max_running=batch)
    return _fleet(checked, policy, tokenizer, batch, staging_dir, timeout)


def _fleet(
    urls: list[str],
    policy: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    batch: int,
    staging_dir: str | os.PathLike | None,
    timeout: float,
) -> SGLangClient:
    try:
        from furlong.rollout.control import ADMIN_TOKEN_ENV
        from furlong.rollout.sglang_client import SGLangClient
    except ImportError as e:  # httpx comes with the server extra
        raise InputError(f'rollout.engine: "sglang" needs {e.name} (furlong[server])') from e

    client = SGLangClient(
        urls,
        tokenizer=tokenizer,
        context_length=getattr(policy.config, "max_position_embeddings", None),
        routed_experts_shape=routed_experts_shape(policy),
        staging_dir=staging_dir,
        timeout=timeout,
        admin_token=os.environ.get(ADMIN_TOKEN_ENV, "").strip() or None,
        max_concurrency=max(1, math.ceil(batch / len(urls))),
    )
    try:
        for i in range(len(urls)):
            _check_server(client, i, policy, staging_dir)
        weights = {name: p.detach() for name, p in policy.named_parameters()}
        client.update_weights(weights, version=0)  # the servers may hold other weights
    except BaseException:
        client.close()
        raise
    return client


def routed_experts_shape(policy: torch.nn.Module) -> tuple[int, int] | None:
    """(router layers, top_k) of an MoE policy's routed-expert rows; None when dense."""
    routers = find_routers(policy)
    if not routers:
        return None
    return len(routers), int(policy.config.num_experts_per_tok)


def _check_server(
    client: SGLangClient, i: int, policy: torch.nn.Module, staging_dir: str | os.PathLike | None
) -> None:
    """Server ``i`` answers and serves a model the policy's weights fit, as far as it says."""
    import httpx

    field, url = f"rollout.urls[{i}]", client.urls[i]
    try:
        info = client.model_info(i)
    except (httpx.HTTPError, ValueError) as e:
        raise InputError(f"{field}: {url} does not answer /get_model_info ({e})") from e
    ours = info.get("furlong") if isinstance(info, dict) else None
    if ours is None:  # real SGLang: says nothing to compare, and loads weights from disk only
        if not staging_dir:
            raise InputError(
                f"rollout.staging_dir: {url} is an SGLang server, which loads published "
                "weights from disk; give a directory it can read"
            )
        return
    vocab = int(policy.get_output_embeddings().out_features)
    if ours.get("vocab_size") != vocab:
        raise InputError(
            f"{field}: {url} serves a vocabulary of {ours.get('vocab_size')} ids, "
            f"the policy has {vocab}"
        )
    shape = ours.get("routed_experts_shape")
    theirs, policy_shape = (tuple(shape) if shape else None), routed_experts_shape(policy)
    if theirs != policy_shape:
        raise InputError(
            f"{field}: {url} serves routed experts of shape {theirs}, the policy's are "
            f"{policy_shape} (a different model)"
        )
