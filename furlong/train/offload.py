"""Optimizer-state stores: ``memory`` (torch allocates the state, the default) and ``disk``
(every state tensor lives in a file-backed MAP_SHARED mapping on a real disk, made by
:mod:`furlong.train.filemap`).

Why disk: anonymous (and pinned) host memory is unreclaimable and fully charged to the
process's memory cgroup. Shared file pages are page cache: clean pages are dropped and dirty
ones written back under pressure, so optimizer state larger than RAM lives on disk with RAM as
a cache. Costs: page faults read from disk, and pageable memory makes host<->device copies
synchronous (``non_blocking`` needs pinned memory).

On CPU the optimizer steps on the mapped tensors directly. On an accelerator the state stays
in the mappings and the step streams it chunk by chunk (``chunk_bytes``) to the device and
back, so the device holds one chunk of state at a time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence

import torch
from torch.optim.optimizer import _get_scalar_dtype  # the dtype torch gives Adam's step

from furlong.errors import InputError
from furlong.train.filemap import FileAllocator, is_file_backed, process_dir
from furlong.train.muon import Muon

log = logging.getLogger(__name__)


class MemoryStore:
    """Optimizer state where torch puts it (host or device memory)."""

    kind = "memory"

    def step(self, parts: Sequence[torch.optim.Optimizer]) -> None:
        for part in parts:
            part.step()

    def load_state(self, part: torch.optim.Optimizer, state_dict: dict) -> None:
        part.load_state_dict(state_dict)  # torch moves the state to each parameter's device

    def file_backed_bytes(self, parts: Sequence[torch.optim.Optimizer]) -> int:
        return 0


class DiskStore:
    """Optimizer state in file-backed mappings of ``disk_dir``: created there before the step
    that first needs it, and loaded checkpoint state goes straight into them."""

    kind = "disk"

    def __init__(self, disk_dir: str | os.PathLike, chunk_bytes: int):
        check_chunk_bytes(chunk_bytes)
        self.allocator = FileAllocator(process_dir(disk_dir))
        self.chunk_bytes = chunk_bytes
        self.stream: bool | None = None  # None: stream when the parameters are off the CPU
        self._warned: set[int] = set()  # parameters already reported as over chunk_bytes

    def step(self, parts: Sequence[torch.optim.Optimizer]) -> None:
        for part in parts:
            live = []
            for group in part.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._create_state(part, group, p)
                        live.append(p)
            if self.stream or (self.stream is None and any(p.device.type != "cpu" for p in live)):
                self._streamed_step(part, live)
            else:
                part.step()  # on the mappings themselves
        log.info(
            "optimizer state: %d bytes file-backed in %s",
            self.file_backed_bytes(parts),
            self.allocator.directory,
        )

    def load_state(self, part: torch.optim.Optimizer, state_dict: dict) -> None:
        """Param groups through torch; the state straight into mappings (torch would first
        move it to the parameters' device: the whole state at once on a GPU)."""
        part.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        params = [p for g in part.param_groups for p in g["params"]]
        for index, saved in state_dict["state"].items():
            p = params[index]
            part.state[p] = {
                # floating state takes the parameter's dtype, as in torch's load_state_dict
                key: self.allocator.adopt(value.to(p.dtype) if value.is_floating_point() else value)
                if isinstance(value, torch.Tensor) and value.dim() > 0
                else value
                for key, value in saved.items()
            }

    def adopt(self, parts: Sequence[torch.optim.Optimizer]) -> None:
        """Move every state tensor of ``parts`` into mappings (mapped ones stay as they are)."""
        for part in parts:
            for state in part.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        state[key] = self.allocator.adopt(value)

    def file_backed_bytes(self, parts: Sequence[torch.optim.Optimizer]) -> int:
        return sum(
            v.nbytes
            for part in parts
            for state in part.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and is_file_backed(v)
        )

    def _create_state(self, part: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> None:
        """The state torch would create lazily in this step, but in mappings (same values)."""
        state = part.state[p]
        zeros = self._zeros
        if isinstance(part, Muon):
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = zeros(p)
        elif isinstance(part, torch.optim.Adam):  # AdamW too: torch.optim.Adam._init_group
            if group["fused"] or group["capturable"]:
                raise ValueError("disk optimizer state: fused/capturable Adam is not supported")
            if len(state) == 0:
                # torch keeps the non-capturable step on the host, as a scalar tensor
                scalar = _get_scalar_dtype()
                state["step"] = torch.tensor(0.0, dtype=scalar)
                state["exp_avg"] = zeros(p)
                state["exp_avg_sq"] = zeros(p)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = zeros(p)
        else:
            raise TypeError(f"disk optimizer state: no state layout for {type(part).__name__}")

    def _zeros(self, p: torch.Tensor) -> torch.Tensor:
        return self.allocator.empty(p.shape, p.dtype).zero_()

    def _streamed_step(self, part: torch.optim.Optimizer, live: list[torch.Tensor]) -> None:
        """Step ``chunk_bytes`` of state at a time: copy it to the device, step only those
        parameters (the others' gradients are hidden), copy it back. Copies from pageable
        memory are synchronous, which also orders them against the step."""
        grads = {id(p): p.grad for p in live}
        try:
            for chunk in self._chunks(part, live):
                ids = {id(p) for p in chunk}
                for p in live:
                    p.grad = grads[id(p)] if id(p) in ids else None
                hosts = [self._to_device(part.state[p], p.device) for p in chunk]
                try:
                    part.step()
                finally:
                    for p, host in zip(chunk, hosts, strict=True):
                        state = part.state[p]
                        for key, mapped in host.items():
                            mapped.copy_(state[key])
                            state[key] = mapped
        finally:
            for p in live:
                p.grad = grads[id(p)]

    @staticmethod
    def _to_device(state: dict, device: torch.device) -> dict[str, torch.Tensor]:
        host = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        for key, mapped in host.items():
            state[key] = mapped.to(device, copy=True)  # copy: also on CPU, when forced
        return host

    def _chunks(
        self, part: torch.optim.Optimizer, live: list[torch.Tensor]
    ) -> Iterator[list[torch.Tensor]]:
        """Consecutive parameters up to ``chunk_bytes`` of state; one parameter (a whole Muon
        matrix stack) is never split."""
        chunk: list[torch.Tensor] = []
        size = 0
        for p in live:
            nbytes = sum(v.nbytes for v in part.state[p].values() if isinstance(v, torch.Tensor))
            if nbytes > self.chunk_bytes and id(p) not in self._warned:
                self._warned.add(id(p))
                log.warning(
                    "optimizer state: a parameter %s holds %d bytes of state, above "
                    "chunk_bytes %d; it is streamed as one chunk",
                    tuple(p.shape),
                    nbytes,
                    self.chunk_bytes,
                )
            if chunk and size + nbytes > self.chunk_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append(p)
            size += nbytes
        if chunk:
            yield chunk


def check_chunk_bytes(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(
            f"optimizer.chunk_bytes: must be an integer > 0, got {value!r} (0 would stream the "
            "whole state as one chunk: no peak saving on the device)"
        )


def make_store(kind: str, disk_dir: str | None, chunk_bytes: int) -> MemoryStore | DiskStore:
    if kind == "memory":
        return MemoryStore()
    if kind == "disk":
        if not disk_dir:
            raise InputError("optimizer.disk_dir: required for state_store 'disk'")
        return DiskStore(disk_dir, chunk_bytes)
    raise InputError(f"optimizer.state_store: {kind!r} is not one of 'memory', 'disk'")
