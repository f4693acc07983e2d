"""A multi-rank trainer behind the TrainingEngine API, driven from one controller process.

:class:`TrainerGroup` spawns N rank processes on this host (torch.multiprocessing, gloo on CPU
or nccl on GPU); each builds a :class:`~furlong.train.distributed.DistributedEngine`, and every
call is forwarded to all ranks, rank 0's result returned. The RL loop and the Tinker service
take it wherever they take a TrainingEngine. ``furlong.rl.ray_trainer`` places the same ranks
as Ray actors. Scripts that run every rank themselves use ``torchrun`` and the
DistributedEngine directly.

User scripts that create a group must guard their entry point with
``if __name__ == "__main__":`` (the ranks are spawned, which re-imports the main module).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import socket
import tempfile
import traceback
import weakref
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from furlong.errors import InputError
from furlong.train.api import Info, LossCall, StrPath, Trainer
from furlong.train.distributed import DistributedEngine, init_distributed
from furlong.train.engine import EngineConfig
from furlong.types import AdamParams, ForwardResult

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# what a controller may call on the ranks (methods, or attributes read on rank 0)
METHODS = frozenset(
    {
        "run_loss",
        "optim_step",
        "zero_grad",
        "save_state",
        "load_state",
        "export_hf",
        "weights",
        "full_weights",
        "full_gradients",
        "step",
        "param_names",
    }
)


@dataclass(frozen=True)
class RankSpec:
    """What every rank builds: the same model (a preset with its seed, or an HF directory)."""

    model: str
    seed: int = 0
    dtype: str = "float32"
    config: EngineConfig = field(default_factory=EngineConfig)
    backend: str | None = None  # None: nccl on a CUDA device, else gloo
    threads: int | None = None  # CPU intra-op threads per rank; None: cores // ranks

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InputError(f"dtype: {self.dtype!r} is not one of {sorted(DTYPES)}")


class RankWorker:
    """One rank's end of a group: joins the process group, builds the engine, runs calls."""

    def __init__(self, spec: RankSpec, rank: int, world_size: int, init_method: str):
        config = spec.config
        if torch.device(config.device).type == "cuda":  # this rank's device: LOCAL_RANK's
            config = replace(config, device="cuda")
        else:  # ranks share the host's cores
            torch.set_num_threads(spec.threads or max(1, (os.cpu_count() or 1) // world_size))
        self.rank = rank
        backend = spec.backend or ("nccl" if config.device == "cuda" else "gloo")
        init_distributed(backend, init_method, rank, world_size)
        self.engine = DistributedEngine.from_pretrained(
            spec.model, config, spec.seed, DTYPES[spec.dtype]
        )

    def call(
        self, method: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        """Rank 0 returns the result; the others return None (their copy is the same)."""
        if method not in METHODS:
            raise InputError(f"method: {method!r} is not one of {sorted(METHODS)}")
        target = getattr(self.engine, method)
        if callable(target):
            target = target(*args, **(kwargs or {}))
        return target if self.rank == 0 else None

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class GroupAPI(Trainer):
    """The TrainingEngine API over ``_call`` (every rank runs it; rank 0's result returns)."""

    @abstractmethod
    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` on every rank; rank 0's result."""

    def run_loss(self, call: LossCall) -> ForwardResult:
        return self._call("run_loss", call)

    def optim_step(self, adam_params: AdamParams | None = None) -> dict[str, float]:
        return self._call("optim_step", adam_params)

    def zero_grad(self) -> None:
        self._call("zero_grad")

    def save_state(self, path: StrPath, info: Info = None) -> Path:
        return self._call("save_state", path, info)

    def load_state(self, path: StrPath, optimizer: bool = True, expect_info: Info = None) -> None:
        self._call("load_state", path, optimizer, expect_info)

    def export_hf(self, path: StrPath) -> Path:
        return self._call("export_hf", path)

    def weights(self) -> Any:
        """What a rollout engine takes to sample like the group: rank 0's whole weights."""
        return self._call("weights")

    full_weights = weights

    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        return self._call("full_gradients")

    @property
    def step(self) -> int:
        return self._call("step")


class TrainerGroup(GroupAPI):
    """N rank processes on this host; close() (or the context manager) stops them."""

    def __init__(
        self,
        model: str | os.PathLike,
        ranks: int,
        config: EngineConfig | None = None,
        *,
        seed: int = 0,
        dtype: str = "float32",
        backend: str | None = None,
        threads: int | None = None,
    ):
        """``model``: a preset (every rank seeds it with ``seed``) or an HF directory."""
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise InputError(f"ranks: must be an integer >= 1, got {ranks!r}")
        spec = RankSpec(str(model), seed, dtype, config or EngineConfig(), backend, threads)
        self.world_size = ranks
        self._dir = tempfile.mkdtemp(prefix="furlong-group-")
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        # registered before the first rank starts: a start that fails part-way (a script
        # without a __main__ guard fails in every spawned rank) stops the ranks started and
        # removes the directory
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._conns, self._dir)
        try:
            init = f"file://{self._dir}/rendezvous"  # a file store: no port to pick or collide on
            ctx = mp.get_context("spawn")
            for rank in range(ranks):
                parent, child = ctx.Pipe()
                self._conns.append(parent)
                proc = ctx.Process(
                    target=_rank_main,
                    args=(spec, rank, ranks, init, child),
                    daemon=True,
                    name=f"furlong-rank-{rank}",
                )
                try:
                    proc.start()
                finally:
                    child.close()
                self._procs.append(proc)
            self._replies()  # every rank has built its engine
            self.param_names: list[str] = self._call("param_names")
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_spec(cls, spec: RankSpec, ranks: int) -> TrainerGroup:
        return cls(
            spec.model,
            ranks,
            spec.config,
            seed=spec.seed,
            dtype=spec.dtype,
            backend=spec.backend,
            threads=spec.threads,
        )

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if not self._finalizer.alive:
            raise RuntimeError("TrainerGroup: the group is closed")
        message = pickle.dumps(("call", method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._conns:
            conn.send_bytes(message)
        return self._replies()

    def _replies(self) -> Any:
        """Every rank's reply (rank 0's value); a rank's error is raised here, a dead rank
        closes the group."""
        replies: dict[int, tuple] = {}
        waiting = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        while waiting:
            for ready in wait([*waiting, *sentinels]):
                if ready in waiting:
                    rank = waiting.pop(ready)
                    try:
                        replies[rank] = pickle.loads(ready.recv_bytes())
                    except (EOFError, OSError):
                        self._died(rank)
                elif ready in sentinels:
                    rank = sentinels.pop(ready)
                    conn = self._conns[rank]
                    if conn in waiting and not conn.poll():  # no reply is coming
                        self._died(rank)
        errors = [replies[r] for r in sorted(replies) if replies[r][0] == "error"]
        if errors:
            _, exc, where = errors[0]
            exc.add_note(f"(raised on a trainer rank)\n{where}")
            raise exc
        return replies[0][1]

    def _died(self, rank: int) -> None:
        code = self._procs[rank].exitcode
        self.close()
        raise RuntimeError(f"TrainerGroup: rank {rank} died (exit code {code}); group closed")

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> TrainerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _shutdown(procs: list, conns: list[Connection], directory: str) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):  # that rank may be gone already
            conn.send_bytes(pickle.dumps(("close",)))
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
    for conn in conns:
        conn.close()
    shutil.rmtree(directory, ignore_errors=True)


def loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), None)


def _rank_main(spec: RankSpec, rank: int, world: int, init: str, conn: Connection) -> None:
    """A rank process: build, then serve calls until "close" (or the controller is gone)."""
    lo = loopback_interface()
    if lo is not None:  # one host: keep gloo's traffic on loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    os.environ["LOCAL_RANK"] = str(rank)  # on GPUs: rank r uses device r of this host
    try:
        worker = RankWorker(spec, rank, world, init)
        _reply(conn, ("ok", None))
    except BaseException as exc:
        _reply(conn, _error(exc))
        return
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the controller is gone
        if message[0] == "close":
            break
        _, method, args, kwargs = message
        try:
            _reply(conn, ("ok", worker.call(method, args, kwargs)))
        except BaseException as exc:
            _reply(conn, _error(exc))
    worker.close()


def _error(exc: BaseException) -> tuple:
    where = traceback.format_exc()
    try:
        pickle.dumps(exc)
    except Exception:
        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
    return ("error", exc, where)


def _reply(conn: Connection, value: tuple) -> None:
    conn.send_bytes(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
