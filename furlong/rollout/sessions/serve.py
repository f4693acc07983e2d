"""A standalone session server: a model, the embedded engine, and uvicorn."""

from __future__ import annotations

from fastapi import FastAPI

from furlong.rollout.control import ControlPolicy
from furlong.rollout.engine import EmbeddedEngine
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
) -> FastAPI:
    """The app for ``model`` (a preset name or a local HF directory). The configuration is
    validated before the model is loaded."""
    from furlong.models import load_model

    config = SessionServerConfig(
        pause_mode=pause_mode,  # type: ignore[arg-type]  # validated by the config
        routing_replay=routing_replay,
        model_name=model,
    )
    net, tokenizer = load_model(model, seed=seed)
    engine = EmbeddedEngine(net, tokenizer, max_running=max_running)
    return create_app(SessionServer(engine, config), policy=policy)


def serve(
    model: str,
    host: str,
    port: int,
    pause_mode: str,
    policy: ControlPolicy,
    **options: object,
) -> None:
    import uvicorn

    app = build(model, pause_mode, policy=policy, **options)  # type: ignore[arg-type]
    print(f"furlong session-server: agents at http://{host}:{port}/sessions/{{id}}/v1", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
