"""Run by tests/train/test_torchrun.py under ``torchrun --nproc-per-node 2``: every rank runs this
script, as a user's torchrun script would. The MoE model trains with forced expert routes on
2 ranks and, beside it on each rank, in one process; rank 0 writes the largest differences
(relative to max(1, |value|)) as JSON to ``argv[1]``."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from furlong.train.distributed import DistributedEngine, init_distributed
from furlong.train.engine import EngineConfig, TrainingEngine
from furlong.types import AdamParams
from tests.train.helpers import random_datums

PRESET = "tiny-qwen3-moe"
CONFIG = EngineConfig(max_tokens_per_microbatch=24)
ADAM = AdamParams(learning_rate=1e-4, grad_clip_norm=1.0)  # updates 100x the tolerance


def routes(lengths: list[int], seed: int) -> list[torch.Tensor]:
    """Distinct expert pairs per position and layer: ``[n, 2 layers, top-2]`` of 8 experts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        first = torch.randint(0, 8, (n, 2), generator=g)
        second = (first + 1 + torch.randint(0, 7, (n, 2), generator=g)) % 8
        out.append(torch.stack([first, second], -1))
    return out


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) / max(1.0, float(a[k].abs().max())) for k in a)


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    rank, world = init_distributed()
    ranks = DistributedEngine.from_pretrained(PRESET, CONFIG, seed=0)
    one = TrainingEngine.from_pretrained(PRESET, CONFIG, seed=0)
    diffs = {"outputs": 0.0, "loss": 0.0, "grads": 0.0, "params": 0.0}
    for step, lengths in enumerate([[7, 3, 11, 5, 9], [6], [4, 8, 5]]):  # [6]: a padding rank
        data = random_datums(lengths, "importance_sampling", seed=step)
        kw = {"routed_experts": routes(lengths, step)}
        a = one.forward_backward(data, "importance_sampling", **kw)
        b = ranks.forward_backward(data, "importance_sampling", **kw)
        for x, y in zip(a.outputs, b.outputs, strict=True):
            diffs["outputs"] = max(diffs["outputs"], worst(x, y))
        gap = abs(a.metrics["loss:sum"] - b.metrics["loss:sum"])
        diffs["loss"] = max(diffs["loss"], gap / max(1.0, abs(a.metrics["loss:sum"])))
        mine = {n: p.grad for n, p in zip(one.param_names, one.params, strict=True)}
        diffs["grads"] = max(diffs["grads"], worst(mine, ranks.full_gradients()))
        one.optim_step(ADAM)
        ranks.optim_step(ADAM)
        weights = ranks.full_weights()  # a collective: every rank calls it
        if rank == 0:
            mine = {n: p.detach() for n, p in zip(one.param_names, one.params, strict=True)}
            diffs["params"] = max(diffs["params"], worst(mine, weights))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world_size": world, "steps": ranks.step, **diffs}, f)
    # leave together: a rank exiting while gloo still runs its peer's threads can abort
    # ("terminate called without an active exception"); it still did once in ~40 suite runs
    # (2026-12-07), from the exit's C++ destructors after the group was gone: skip them
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
