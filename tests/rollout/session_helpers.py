"""Shared pieces of the session-server tests: a real server on 127.0.0.1 over an engine that
records what each turn asked for (and can play a faulty engine)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import httpx
import torch

from furlong.models import build_preset
from furlong.rollout.base import GenerateResult
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sampling import SamplingParams
from furlong.rollout.sessions import SessionServer, SessionServerConfig, create_app
from furlong.serving import background_server

_MODELS: dict[str, tuple[Any, Any]] = {}


def model(preset: str) -> tuple[Any, Any]:
    """A fresh copy of a seeded preset (built once per process)."""
    if preset not in _MODELS:
        _MODELS[preset] = build_preset(preset, seed=0)
    net, tokenizer = _MODELS[preset]
    return copy.deepcopy(net), tokenizer


class SpyEngine:
    """Delegates to an ``EmbeddedEngine``, recording every submitted ``SamplingParams``;
    ``edit`` rewrites results (a faulty engine)."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        edit: Callable[[GenerateResult], GenerateResult] | None = None,
    ):
        self.engine, self.edit = engine, edit
        self.params: list[SamplingParams] = []
        self.prompts: list[list[int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def submit(
        self, prompt: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Future[GenerateResult]:
        inner = self.engine.submit(prompt, params, request_id)
        self.params.append(params)
        self.prompts.append(list(prompt))
        if self.edit is None:
            return inner
        outer: Future[GenerateResult] = Future()

        def done(f: Future[GenerateResult]) -> None:
            try:
                outer.set_result(self.edit(f.result()))
            except Exception as exc:  # noqa: BLE001 - handed to the waiting turn
                outer.set_exception(exc)

        inner.add_done_callback(done)
        return outer


@contextmanager
def serve(
    preset: str = "tiny-qwen3",
    pause_mode: str = "abort",
    edit: Callable[[GenerateResult], GenerateResult] | None = None,
    engine: EmbeddedEngine | None = None,
    **config: Any,
) -> Iterator[tuple[SessionServer, SpyEngine, httpx.Client]]:
    if engine is None:
        engine = EmbeddedEngine(*model(preset))
    spy = SpyEngine(engine, edit)
    server = SessionServer(spy, SessionServerConfig(pause_mode=pause_mode, **config))
    with (
        background_server(create_app(server)) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        yield server, spy, client


def open_session(client: httpx.Client, **body: Any) -> str:
    response = client.post("/sessions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["id"]


def chat(client: httpx.Client, sid: str, messages: list[dict], **params: Any) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 8, "seed": 0, **params}
    return client.post(f"/sessions/{sid}/v1/chat/completions", json=body)


def turn(client: httpx.Client, sid: str, messages: list[dict], **params: Any) -> dict:
    """A successful turn's assistant message."""
    response = chat(client, sid, messages, **params)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


def info(client: httpx.Client, sid: str) -> dict:
    response = client.get(f"/sessions/{sid}")
    assert response.status_code == 200, response.text
    return response.json()


def checkpoint_len(record: dict) -> int:
    return len(record["prompt_ids"]) + len(record["output_ids"])


def perturbed(model: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: p.detach() + 0.05 * torch.randn(p.shape, generator=g)
        for n, p in model.named_parameters()
    }
