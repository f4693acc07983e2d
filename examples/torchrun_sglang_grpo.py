"""GRPO with the trainer on N ranks (torchrun, FSDP2) and rollouts on an SGLang server.

    export FURLONG_ADMIN_TOKEN=$(python -c "import secrets; print(secrets.token_urlsafe(32))")
    furlong rollout-server --model tiny-qwen3 --port 30000 &   # a CPU stand-in for SGLang
    torchrun --standalone --nproc-per-node 2 examples/torchrun_sglang_grpo.py \
        --model tiny-qwen3 --engine http://127.0.0.1:30000 --steps 3

Every rank runs this script. Rank 0 talks to the engine: it samples, scores and computes the
advantages, and after each step publishes the weights the ranks gathered for it. The datums go
to every rank (a broadcast); each rank trains on its share of them. On GPUs the engine is a
real SGLang server and ``--staging-dir`` a filesystem both sides see (docs/scaling.md).
Weights are published with ``$FURLONG_ADMIN_TOKEN``, the rollout server's admin token.
"""

from __future__ import annotations

import argparse
import os
import random

import torch
import torch.distributed as dist

from furlong.rl import advantages as adv
from furlong.rl import tasks
from furlong.rl.episodes import generate_episodes
from furlong.rollout.sampling import SamplingParams
from furlong.rollout.sglang_client import SGLangClient
from furlong.train.distributed import DistributedEngine, init_distributed
from furlong.train.engine import EngineConfig
from furlong.types import AdamParams


def main() -> None:
    parser = argparse.ArgumentParser(description="GRPO: torchrun trainer + SGLang rollouts")
    parser.add_argument("--model", default="tiny-qwen3", help="preset or HF directory")
    parser.add_argument("--engine", default="http://127.0.0.1:30000", help="SGLang base URL")
    parser.add_argument("--staging-dir", help="shared filesystem for weights (real SGLang)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--reward", default="short", help="short | exact_number | ...")
    args = parser.parse_args()

    rank, _ = init_distributed()  # nccl on GPUs, gloo on CPU
    gpu = torch.cuda.is_available()
    trainer = DistributedEngine.from_pretrained(
        args.model,
        EngineConfig(device="cuda" if gpu else "cpu"),
        dtype=torch.bfloat16 if gpu else torch.float32,
    )
    # a dense reward a random tiny model can learn (shorter is better); exact_number for real
    tasks.REWARDS.setdefault("short", lambda response, problem: -len(response) / 10)
    task = tasks.build_task("addition", args.reward)
    token = os.environ.get("FURLONG_ADMIN_TOKEN")  # the rollout server's control routes
    engine = (
        SGLangClient(args.engine, staging_dir=args.staging_dir, admin_token=token)
        if rank == 0
        else None
    )
    rng = random.Random(0)
    for step in range(1, args.steps + 1):
        data = None
        if engine is not None:
            problems = task.sample(args.prompts, rng)
            params = SamplingParams(max_tokens=8, seed=step)
            episodes = generate_episodes(
                engine, trainer.tokenizer, problems, args.group, params, task
            )
            rewards = torch.tensor([e.reward for e in episodes])
            lengths = [len(e.response) for e in episodes]
            advantages = adv.grpo(rewards, lengths, args.group)
            data = [  # token-mean normalization, as per-token weights (the engine sums raw)
                e.datum(
                    {
                        "logprobs": torch.tensor(e.result.output_logprobs),
                        "advantages": a / sum(lengths),
                    }
                )
                for e, a in zip(episodes, advantages, strict=True)
            ]
            print(f"step {step}: reward {rewards.mean():.2f}", flush=True)
        box = [data]  # Datums pickle
        dist.broadcast_object_list(box, src=0)
        out = trainer.forward_backward(box[0], "importance_sampling")
        stats = trainer.optim_step(AdamParams(learning_rate=1e-3, grad_clip_norm=1.0))
        weights = trainer.weights()  # a collective: whole on rank 0, empty elsewhere
        if engine is not None:
            # the trainer scored the engine's samples with the same weights: fp32 ~1e-6
            gap = torch.cat(
                [
                    (o["logprobs"][-len(e.response) :] - torch.tensor(e.result.output_logprobs))
                    for o, e in zip(out.outputs, episodes, strict=True)
                ]
            ).abs()
            engine.update_weights(weights, step)
            loss, norm = out.metrics["loss:sum"], stats["grad_norm:mean"]
            print(
                f"  loss {loss:.4f}, grad norm {norm:.3f}, trainer/engine log-prob gap "
                f"{gap.mean():.1e}, engine at v{step}",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
