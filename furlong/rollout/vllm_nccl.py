"""The GPU transport of the vLLM kind (``rollout.vllm_transport = "nccl"``): vLLM's native
four-phase weight sync (``/init_weight_transfer_engine`` once, then per publication
``/start_weight_update``, ``/update_weights`` beside the NCCL broadcast,
``/finish_weight_update`` with the version), driven by vLLM's own trainer-side engine, as TRL
and SkyRL drive it. Servers start with ``--weight-transfer-config '{"backend": "nccl"}'``.

It needs ``vllm`` importable in the trainer's environment and a CUDA device: the usual GPU
deployment. **Not validated here** (no GPU): the tests build its requests with vLLM's own
classes on a CPU, and nothing more.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import torch

from furlong.errors import InputError


def init_info(master_address: str, master_port: int, servers: int) -> dict[str, Any]:
    """``NCCLTrainerInitInfo``'s fields: the trainer is rank 0, one worker per server after it
    (tensor-parallel servers add their ranks: give ``servers`` as the total worker count)."""
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "world_size": 1 + int(servers),
        "rank": 0,
    }


def update_info(weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``NCCLWeightTransferUpdateInfo``'s fields for one publication of ``weights``."""
    return {
        "names": list(weights),
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in weights.values()],
        "shapes": [list(t.shape) for t in weights.values()],
    }


class NcclSync:
    """One trainer-side NCCL group to the servers at ``urls``, sending ``weights`` (the client's
    tensors, updated in place between publications) each time :meth:`send` is called."""

    def __init__(self, urls: list[str], weights: Mapping[str, torch.Tensor], port: int = 29555):
        try:
            from vllm.distributed.weight_transfer import base, clients, nccl_engine
        except ImportError as e:
            raise InputError(
                'rollout.vllm_transport: "nccl" runs vLLM\'s own trainer-side engine, and vllm '
                'is not importable here (a GPU box: pip install vllm; on a CPU use "disk")'
            ) from e
        if not torch.cuda.is_available():
            raise InputError('rollout.vllm_transport: "nccl" needs a CUDA device; use "disk"')
        if len(urls) != 1:
            raise InputError('rollout.urls: the "nccl" transport drives one server (one group)')
        self._weights = {k: v.cuda() for k, v in weights.items()}
        source = _Source(base, self._weights)
        client = clients.HTTPVLLMWeightSyncClient(urls[0])
        info = nccl_engine.NCCLTrainerInitInfo(**init_info("127.0.0.1", port, 1))
        self._engine = nccl_engine.NCCLTrainerWeightTransferEngine.trainer_init(
            info, client=client, source=source
        )
        self._http = httpx.Client(base_url=urls[0], timeout=600.0)
        self._host = weights

    def send(self, version: int) -> float:
        tick = time.perf_counter()
        for name, tensor in self._host.items():
            self._weights[name].copy_(tensor, non_blocking=True)
        self._http.post("/pause", params={"mode": "wait"}).raise_for_status()
        try:  # start, update beside the broadcast, finish: vLLM's engine drives all three
            self._engine.send_weights()
            body = {"new_version": str(version)}
            self._http.post("/update_weight_version", json=body).raise_for_status()
        finally:
            self._http.post("/resume").raise_for_status()
        return time.perf_counter() - tick


def _Source(base: Any, weights: Mapping[str, torch.Tensor]) -> Any:
    """vLLM's ``WeightSource`` over a name -> tensor mapping."""

    class MappingSource(base.WeightSource):
        def metadata(self) -> list[Any]:
            return [base.ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in weights.items()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(weights.items())

    return MappingSource()
