"""A :class:`~furlong.rollout.base.RolloutEngine` over SGLang's HTTP protocol.

Points at ``furlong rollout-server`` or at a real SGLang server (``python -m
sglang.launch_server ... --enable-return-routed-experts --enable-memory-saver``); switching is
a base-URL change. Each prompt is its own ``/generate`` call, sent concurrently so the server
batches them continuously. ``update_weights`` takes a safetensors file or an HF directory the
server can read (``/update_weights_from_disk``), or a state dict: written to ``staging_dir``
(a filesystem shared with the server; works with SGLang) or, without one, sent in buckets of
``bucket_bytes`` over HTTP (furlong's server only).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from safetensors.torch import save, save_file

from furlong.errors import InputError
from furlong.rollout import sglang_wire as wire
from furlong.rollout.base import (
    GenerateResult,
    MemoryTag,
    PauseMode,
    Weights,
    check_pause_mode,
    check_tags,
    expand_params,
)
from furlong.rollout.sampling import SamplingParams


class SGLangClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 600.0,
        max_concurrency: int = 64,
        routed_experts_shape: tuple[int, int] | None = None,
        staging_dir: str | os.PathLike | None = None,
        bucket_bytes: int = 64 << 20,
    ):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="sglang-client")
        self._routing_shape = routed_experts_shape
        self._staging = Path(staging_dir) if staging_dir else None
        self._bucket_bytes = bucket_bytes

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._http.close()

    def __enter__(self) -> SGLangClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- generation

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerateResult]:
        plist = expand_params(len(prompts), params)
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise InputError(f"prompts[{i}]: empty")
        shape = self._routing() if any(p.return_routed_experts for p in plist) else None
        jobs = [
            self._pool.submit(self._generate_one, i, [int(t) for t in prompt], p, shape)
            for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True))
        ]
        return [job.result() for job in jobs]

    def _generate_one(
        self, index: int, prompt: list[int], params: SamplingParams, shape
    ) -> GenerateResult:
        body = self._post("/generate", wire.request_body(prompt, params), where=f"prompts[{index}]")
        return wire.generate_result(body, prompt, params, shape)

    def _routing(self) -> tuple[int, int]:
        if self._routing_shape is None:
            info = self._get("/get_model_info").get("furlong") or {}
            shape = info.get("routed_experts_shape")
            if not shape:
                raise InputError(
                    "return_routed_experts: the server reports no MoE routing shape; pass "
                    "routed_experts_shape=(layers, top_k) to SGLangClient"
                )
            self._routing_shape = (int(shape[0]), int(shape[1]))
        return self._routing_shape

    # ---------------------------------------------------------------- weights

    @property
    def weight_version(self) -> int:
        return wire.parse_version(self._get("/get_weight_version")["weight_version"]) or 0

    def update_weights(self, weights: Weights, version: int | None = None) -> int:
        if isinstance(weights, Mapping):
            return self._update_from_tensors(weights, version)
        body: dict[str, Any] = {"model_path": str(Path(weights).resolve())}
        if version is not None:
            body["weight_version"] = str(version)
        self._post("/update_weights_from_disk", body, where="update_weights")
        return self.weight_version

    def _update_from_tensors(self, weights: Mapping[str, Any], version: int | None) -> int:
        if self._staging is None:
            return self._update_in_buckets(weights, version)
        self._staging.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self._staging) as tmp:
            path = Path(tmp) / "model.safetensors"
            save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(path))
            return self.update_weights(path, version)

    def _update_in_buckets(self, weights: Mapping[str, Any], version: int | None) -> int:
        buckets: list[dict[str, Any]] = [{}]
        size = 0
        for name, tensor in weights.items():
            nbytes = tensor.numel() * tensor.element_size()
            if buckets[-1] and size + nbytes > self._bucket_bytes:
                buckets.append({})
                size = 0
            buckets[-1][name] = tensor.detach().contiguous().cpu()
            size += nbytes
        new = self.weight_version
        for i, bucket in enumerate(buckets):
            params: dict[str, Any] = {"final": str(i == len(buckets) - 1).lower()}
            if version is not None:
                params["weight_version"] = version
            response = self._http.post(
                "/furlong/update_weights_bucket", content=save(bucket), params=params
            )
            new = int(self._check(response, "update_weights")["weight_version"])
        return new

    # ---------------------------------------------------------------- control

    def abort(self, request_ids: Iterable[int | str] | None = None) -> int:
        if request_ids is None:
            self._post("/abort_request", {"abort_all": True}, where="abort")
            return -1  # the server does not say how many
        ids = list(request_ids)
        for rid in ids:
            self._post("/abort_request", {"rid": str(rid)}, where="abort")
        return len(ids)

    def pause(self, mode: PauseMode = "retract") -> None:
        self._post("/pause_generation", {"mode": check_pause_mode(mode)}, where="pause")

    def resume(self) -> None:
        self._post("/continue_generation", {}, where="resume")

    def offload(self, tags: Iterable[MemoryTag]) -> None:
        self._post("/release_memory_occupation", {"tags": check_tags(tags)}, where="offload")

    def onload(self, tags: Iterable[MemoryTag]) -> None:
        self._post("/resume_memory_occupation", {"tags": check_tags(tags)}, where="onload")

    def health(self) -> bool:
        try:
            return self._http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    # ---------------------------------------------------------------- transport

    def _get(self, path: str) -> Any:
        response = self._http.get(path)
        response.raise_for_status()
        return response.json()

    def _post(self, path: str, body: dict, where: str) -> Any:
        return self._check(self._http.post(path, json=body), where)

    def _check(self, response: httpx.Response, where: str) -> Any:
        path = response.request.url.path
        if response.status_code == 400:  # the server names the bad field
            raise InputError(f"{where}: {_message(response)}")
        if response.status_code != 200:
            raise RuntimeError(f"{where}: {path} returned {response.status_code}: {response.text}")
        return response.json() if response.content else None


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
    return response.text
