"""A standalone session server: a model, an engine of the registry's (the embedded one by
default), and uvicorn."""

from __future__ import annotations

import socket
from typing import Any, cast

from fastapi import FastAPI

from furlong.errors import InputError
from furlong.listen import bind
from furlong.rollout.base import PauseMode, SessionEngine
from furlong.rollout.control import ControlPolicy
from furlong.rollout.registry import EngineRequest, build_engine, engine_class
from furlong.rollout.sessions.app import create_app
from furlong.rollout.sessions.config import SessionServerConfig
from furlong.rollout.sessions.service import SessionServer


def build(
    model: str,
    pause_mode: str,
    max_running: int = 32,
    seed: int = 0,
    routing_replay: bool = True,
    policy: ControlPolicy | None = None,
    engine: str = "embedded",
    engine_options: dict[str, Any] | None = None,
) -> FastAPI:
    """The app for ``model`` (a preset name or a local HF directory), served by an engine of
    kind ``engine``. The configuration and the kind are checked before the model loads."""
    from furlong.models import load_model

    config = SessionServerConfig(
        pause_mode=cast(PauseMode, pause_mode),  # validated by the config
        routing_replay=routing_replay,
        model_name=model,
    )
    engine_class(engine, SessionEngine, "--engine")
    options = dict(engine_options or {})
    if engine == "vllm":
        from furlong.rollout.vllm_client import check_options

        check_options(
            options.get("urls") or [], options.get("vllm_python") or "", "disk", flags=True
        )
        if pause_mode == "retract":
            raise InputError(
                '--pause-mode: "retract" has no vLLM counterpart; use "abort" or "in_place"'
            )
    net, tokenizer = load_model(model, seed=seed)
    request = EngineRequest(net, tokenizer, max_running=max_running, options=options)
    served = build_engine(engine, request, SessionEngine, "--engine")
    return create_app(SessionServer(served, config), policy=policy)


def serve(
    model: str,
    host: str,
    port: int,
    pause_mode: str,
    policy: ControlPolicy,
    sock: socket.socket | None = None,
    **options: Any,  # build's keywords
) -> None:
    """``sock``: the listening socket for ``host``:``port`` (``furlong.listen.bind``; else it
    is opened here, before the model loads)."""
    from furlong.models.names import check_model
    from furlong.serving import run_announced

    check_model(model, "--model")  # before the engine kind's and the model's imports
    sock = bind(host, port) if sock is None else sock
    app = build(model, pause_mode, policy=policy, **options)
    run_announced(
        app,
        host,
        port,
        lambda url: (
            f"furlong session-server: {model} on {url} (OpenAI-compatible /v1 per "
            f"session: {url}/sessions/{{id}}/v1)"
        ),
        sock,
    )
