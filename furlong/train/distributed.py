"""One rank of a data-parallel TrainingEngine: FSDP2 (``fully_shard``) over torch.distributed.

Same API and semantics as :class:`~furlong.train.engine.TrainingEngine`, which it is, with
sharding and the :class:`FSDPRanks` strategy: each call's datums are split across ranks by
tokens (``furlong.train.rank_split``), every rank runs the engine's own microbatch pass on its
share, gradients are reduce-scattered as raw sums (FSDP's divide
factor is 1: no averaging anywhere), and every rank returns the whole call's result, per-datum
outputs in request order. ``optim_step`` clips by the global norm (the engine's step over
sharded DTensor gradients reduces the norm across ranks).

Every rank must make the same calls with the same arguments (torchrun scripts do;
:class:`~furlong.train.group.TrainerGroup` forwards each call to all ranks). Validation runs on
every rank before any collective, so a bad request raises the same ``InputError`` everywhere.

Sharding: each decoder layer is an FSDP unit, the model itself the root unit (embeddings, final
norm, LM head). The engine calls the decoder and the head directly rather than the model's
``forward``, so the root unit is unsharded around each microbatch by hand; its gradients are
reduced by FSDP's end-of-backward callback like any unit whose forward ran.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from furlong.errors import InputError
from furlong.train import dist_checkpoint as dcp_state
from furlong.train.api import Info, StrPath
from furlong.train.engine import EngineConfig, TrainingEngine
from furlong.train.master_weights import LOW_PRECISION
from furlong.train.optim import build_optimizer
from furlong.train.parallel import Results, collect_outputs
from furlong.train.rank_split import rank_microbatches

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def init_distributed(
    backend: str | None = None,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout_s: float = 1800.0,
) -> tuple[int, int]:
    """Join the default process group; ``(rank, world_size)``. Without arguments, from
    torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). ``backend``: nccl
    when CUDA is available, else gloo. On CUDA, LOCAL_RANK picks the device."""
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=-1 if rank is None else rank,
            world_size=-1 if world_size is None else world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    return dist.get_rank(), dist.get_world_size()


def shard_model(model: PreTrainedModel, mesh: DeviceMesh) -> None:
    """``fully_shard`` every decoder layer, then the model; gradients reduce as raw sums. A
    bf16 model is sharded in fp32 (the optimizer's master weights) and FSDP casts each unit to
    bf16 as it gathers it, reducing gradients in fp32: FSDP2's own mixed precision."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not layers:
        raise InputError(f"model: {type(model).__name__} has no decoder layers to shard")
    dtype = next(model.parameters()).dtype
    policy = MixedPrecisionPolicy()
    if dtype in LOW_PRECISION:
        model.float()
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    root = fully_shard(model, mesh=mesh, mp_policy=policy)  # the model itself, class swapped
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # Tinker semantics: sums, never means
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no AVG
    # FSDP picks its root at the first forward: run one through the model itself, because the
    # engine calls the decoder directly (which would make the first layer a root of its own)
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)
    root.reshard()


class FSDPRanks:
    """The FSDP2 strategy: this rank's share of every call (by tokens), the root unit
    unsharded around each microbatch, and every rank's results on every rank."""

    def __init__(self, model: FSDPModule, rank: int, world_size: int):
        self.model, self.rank, self.world_size = model, rank, world_size

    def microbatches(self, lengths: Sequence[int], token_budget: int) -> list[list[int]]:
        return rank_microbatches(lengths, self.world_size, token_budget)[self.rank]

    @contextmanager
    def around_microbatch(self) -> Iterator[None]:
        self.model.unshard()  # the root unit: embeddings, final norm, head (see module doc)
        yield
        self.model.reshard()  # after backward FSDP already did; after forward-only we do

    def gather(
        self, loss_sum: float, results: Results, n: int
    ) -> tuple[list[dict[str, torch.Tensor]], float]:
        """Every rank's outputs, on every rank, in request order, each datum exactly once,
        and the global loss sum (added in rank order, so every rank gets the same float)."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (loss_sum, results))
        outputs = collect_outputs((r for _, part in gathered for r in part), n)
        return outputs, sum(rank_loss for rank_loss, _ in gathered)


class DistributedEngine(TrainingEngine):
    """This rank's part of an N-rank TrainingEngine (FSDP2). Build it on every rank."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        mesh: DeviceMesh | None = None,
    ):
        if not dist.is_initialized():
            raise RuntimeError("DistributedEngine: call init_distributed() first")
        config = config or EngineConfig()
        if config.optimizer.kind != "adamw" or config.optimizer.state_store != "memory":
            raise InputError(
                "optimizer: multi-rank training supports kind 'adamw' with state_store "
                f"'memory', got {config.optimizer.kind!r} / {config.optimizer.state_store!r}"
            )
        if any(not p.requires_grad for p in model.parameters()):
            raise InputError("model: multi-rank training is full fine-tuning (all parameters)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        device = torch.device(config.device)
        self.mesh = mesh or init_device_mesh(device.type, (self.world_size,))
        model.to(device)  # type: ignore[arg-type]  # in place; see ray_rollout.RolloutActor
        shard_model(model, self.mesh)
        assert isinstance(model, FSDPModule)  # fully_shard swapped its class
        ranks = FSDPRanks(model, self.rank, self.world_size)
        super().__init__(model, tokenizer, config, parallel=ranks)

    # ---------------------------------------------------------------- weights and state

    def weights(self) -> dict[str, torch.Tensor]:
        """The trainable weights by name, gathered whole on CPU on rank 0 (others: empty);
        a collective: every rank calls it."""
        return dcp_state.full_weights(self.model, self.param_names)

    full_weights = weights

    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """The accumulated gradients by name, whole, on every rank (for inspection)."""
        return {
            n: None if p.grad is None else dcp_state.unsharded(p.grad).cpu()
            for n, p in zip(self.param_names, self.params, strict=True)
        }

    def save_state(self, path: StrPath, info: Info = None) -> Path:
        """A torch.distributed.checkpoint directory that any number of ranks can load."""
        return dcp_state.save_state(
            path, self.model, self.optimizer, self.param_names, self.step, info
        )

    def load_state(self, path: StrPath, optimizer: bool = True, expect_info: Info = None) -> None:
        """Restore weights (and optimizer state) saved with any number of ranks; everything
        is checked before anything changes."""
        state, step = dcp_state.load_state(
            path, self.model, self.param_names, self.params, optimizer, expect_info
        )
        self.zero_grad()
        self.optimizer = build_optimizer(self.model, self.params, self.config.optimizer)
        if state is not None:
            self.optimizer.load_state_dict(state)
        self.step = step

    def export_hf(self, path: StrPath) -> Path:
        """Rank 0 gathers the full weights and writes a normal HF directory."""
        if self.tokenizer is None:
            raise InputError("export_hf: the engine has no tokenizer to export")
        return dcp_state.export_hf(path, self.model, self.tokenizer)
