"""Train the calculator agent (agent.py) with RL through the session server, on CPU.

    python examples/tool_agent/train.py --steps 3

1. A short supervised warm-up teaches the tiny MoE model the tool-call format (rendered by the
   session server's own renderer: token for token what the sessions will produce).
2. Each RL step opens one session per episode and hands its base URL to the black-box agent,
   which talks plain HTTP. The trainer scores the final answer, fetches the trajectory from
   ``POST /sessions/{id}/samples`` (tool tokens carry loss mask 0; the MoE routes come back as
   incrementally assembled R3 rows) and takes a GRPO step with the routes replayed.
3. The new weights are published through the session server (pause mode ``abort``: a turn in
   flight would come back 503 and the agent would retry it).
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from tqdm import tqdm

from furlong.models import build_preset
from furlong.rl.advantages import grpo
from furlong.rl.tasks import Problem, addition, exact_number
from furlong.rollout.codec import MEDIA_TYPE, decode_samples, opt_in
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sample import Sample
from furlong.rollout.sessions import SessionServer, SessionServerConfig, create_app
from furlong.rollout.sessions.chat import Message, ToolCall
from furlong.rollout.sessions.render import format_tool_call, render_prompt
from furlong.serving import background_server
from furlong.train.engine import TrainingEngine
from furlong.types import AdamParams, Datum

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent import SYSTEM, TOOLS, calculator, solve  # noqa: E402 - the example's own module

MODEL = "tiny-qwen3-moe"


# ---------------------------------------------------------------- warm-up


def ideal_transcript(tokenizer, problem: Problem) -> tuple[list[int], torch.Tensor]:
    """The conversation a good agent has, tokenized as the session would: the tool call, the
    tool's result, the answer. Returns the tokens and a weight per target: 1 on the model's
    two outputs, 0 elsewhere."""
    expr = problem.prompt.removeprefix("What is ").removesuffix("?")
    call = ToolCall("call_0", "calc", f'{{"expr": "{expr}"}}')
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call_ids = tokenizer.encode(format_tool_call(call), add_special_tokens=False) + [im_end]
    messages = [Message("system", SYSTEM), Message("user", problem.prompt)]
    first = render_prompt(tokenizer, messages, TOOLS, lambda m: None)
    messages += [Message("assistant", "", (call,)), Message("tool", calculator(expr))]
    second = render_prompt(tokenizer, messages, TOOLS, lambda m: call_ids)
    tokens = second + tokenizer.encode(problem.answer, add_special_tokens=False) + [im_end]
    weights = torch.zeros(len(tokens) - 1)
    weights[len(first) - 1 : len(first) - 1 + len(call_ids)] = 1.0
    weights[len(second) - 1 :] = 1.0
    return tokens, weights


def warmup(
    actor: TrainingEngine, problems: list[Problem], steps: int, batch: int, rng: random.Random
) -> None:
    adam = AdamParams(learning_rate=3e-3)
    for _ in tqdm(range(steps), desc="warm-up", disable=steps == 0):
        pairs = [ideal_transcript(actor.tokenizer, rng.choice(problems)) for _ in range(batch)]
        total = sum(float(w.sum()) for _, w in pairs)  # mean over the answer tokens
        data = [Datum.next_token(t, weights=w / total) for t, w in pairs]
        actor.forward_backward(data, "cross_entropy")
        actor.optim_step(adam)


# ---------------------------------------------------------------- RL through the sessions


def episode(client: httpx.Client, problem: Problem, seed: int) -> Sample:
    """One black-box agent run in a fresh session; the trainer scores it and takes the
    trajectory back as a training sample."""
    session = client.post("/sessions").json()
    base_url = str(client.base_url).rstrip("/") + session["base_url"]
    outcome = solve(client, base_url, problem.prompt, seed)
    reward = exact_number(outcome.answer, problem) + 0.1 * min(outcome.tool_calls, 1)
    response = client.post(  # the codec's payload, opted in to the MoE routes
        f"/sessions/{session['id']}/samples?fields=routed_experts",
        json={"reward": reward},
        headers={"accept": MEDIA_TYPE},
    )
    client.delete(f"/sessions/{session['id']}")
    (sample,) = decode_samples(response.content, opt_in("routed_experts"))
    return sample


def datum(sample: Sample, advantage: float, scale: float) -> Datum:
    """Tool tokens (loss mask 0) get no advantage, so they carry no gradient."""
    return sample.to_datum(advantages=advantage * scale * sample.loss_mask)


def rl_step(
    actor: TrainingEngine,
    server: SessionServer,
    client: httpx.Client,
    problems: list[Problem],
    group_size: int,
    step: int,
) -> dict[str, float]:
    jobs = [(p, step * 1000 + i) for p in problems for i in range(group_size)]
    with ThreadPoolExecutor(len(jobs)) as pool:  # the agents run concurrently
        samples = list(pool.map(lambda job: episode(client, *job), jobs))
    rewards = torch.tensor([s.reward for s in samples])
    lengths = [s.response_length for s in samples]
    advantages = grpo(rewards, lengths, group_size)
    tokens = sum(float(s.loss_mask.sum()) for s in samples)
    data = [datum(s, float(a[0]), 1.0 / tokens) for s, a in zip(samples, advantages, strict=True)]
    routes = [s.routed_experts for s in samples]
    out = actor.forward_backward(data, "importance_sampling", routed_experts=routes)
    # train/rollout mismatch on the model's own tokens: ~1e-6 when the routes are replayed
    diffs = [
        (o["logprobs"][-s.response_length :] - s.rollout_logprobs).abs()[s.loss_mask > 0]
        for o, s in zip(out.outputs, samples, strict=True)
    ]
    actor.optim_step(AdamParams(learning_rate=1e-3))
    weights = {n: p.detach() for n, p in actor.model.named_parameters()}
    server.publish_weights(weights, step)
    return {
        "reward": float(rewards.mean()),
        "multi_turn": sum(bool((s.loss_mask == 0).any()) for s in samples) / len(samples),
        "logprob_diff_max": float(torch.cat(diffs).max()),
        "loss": out.metrics["loss:sum"],
    }


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=150)
    parser.add_argument("--warmup-batch", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    model, tokenizer = build_preset(MODEL, seed=args.seed)
    train_set, _ = addition(max_a=9, max_b=9)
    actor = TrainingEngine(model, tokenizer)
    warmup(actor, train_set, args.warmup_steps, args.warmup_batch, rng)

    engine = EmbeddedEngine(copy.deepcopy(actor.model), tokenizer)
    server = SessionServer(engine, SessionServerConfig(pause_mode="abort"))
    history = []
    with (
        background_server(create_app(server)) as url,
        httpx.Client(base_url=url, timeout=300) as client,
    ):
        for step in range(1, args.steps + 1):
            problems = [rng.choice(train_set) for _ in range(args.prompts_per_step)]
            metrics = rl_step(actor, server, client, problems, args.group_size, step)
            history.append(metrics)
            print(f"step {step}: " + "  ".join(f"{k} {v:.3g}" for k, v in metrics.items()))
    print(f"done in {time.perf_counter() - start:.1f} s")
    return history


if __name__ == "__main__":
    # tiny matrices: intra-op thread hand-offs cost more than they save (far more on a busy CPU)
    torch.set_num_threads(1)
    main()
