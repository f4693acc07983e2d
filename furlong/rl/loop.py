"""The RL loop, top to bottom:

    generate → reward → critic values → advantages → train critic → train actor → publish → eval

Every loss goes through a TrainingEngine (the actor's objective is the same code the Tinker
service runs); generation goes through a rollout engine holding its own copy of the weights,
refreshed by ``update_weights`` after each step, as on a real cluster.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from furlong.metrics import MetricsLog, plot_metrics
from furlong.models.loading import load_model
from furlong.models.moe import find_routers
from furlong.rl import advantages as adv
from furlong.rl import scale_out
from furlong.rl.config import RLConfig, to_toml
from furlong.rl.episodes import Episode, generate_episodes
from furlong.rl.scale_out import ScaleOut
from furlong.rl.tasks import build_task
from furlong.rl.warmup import evaluate, supervised_warmup
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sampling import SamplingParams
from furlong.train.engine import EngineConfig, TrainingEngine
from furlong.types import AdamParams

PLOTTED = ("reward:mean", "eval_pass1", "eval_greedy", "kl:mean", "entropy:mean", "grad_norm:mean")


@dataclass
class RunSummary:
    before: dict[str, float]  # held-out accuracy after the warm-up, before RL
    after: dict[str, float]
    steps: int
    seconds: float
    out_dir: Path
    hf_dir: Path | None


def train(config: RLConfig, scale: ScaleOut | None = None) -> RunSummary:
    """``scale``: trainer ranks and Ray placement (``furlong.rl.scale_out``); default: the
    config's ``[scale]`` group (one process)."""
    config.validate()
    scale = scale or config.scale
    scale.check(config.colocate.enabled)
    start = time.perf_counter()
    run, ro, algo = config.run, config.rollout, config.algo
    out = Path(run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / "config.toml", to_toml(config))  # `furlong train` reruns it
    rng = random.Random(run.seed)
    torch.manual_seed(run.seed)

    m = config.model
    engine_config = EngineConfig(
        device=m.device, optimizer=config.optimizer, share_prefixes=algo.share_prefixes
    )
    policy, tokenizer = load_model(m.name, seed=m.seed, dtype=getattr(torch, m.dtype))
    policy = policy.to(m.device)
    t = config.task
    task = build_task(t.name, t.reward, t.path, t.max_a, t.max_b)
    held_out = task.eval[: t.eval_size] if t.eval_size else task.eval
    if config.warmup.steps:
        warmup = TrainingEngine(policy, tokenizer, engine_config)
        losses = supervised_warmup(warmup, task, config.warmup, rng, run.progress)
        warm_log = MetricsLog(out / "warmup.jsonl")
        for i, loss in enumerate(losses, 1):
            warm_log.write(i, {"loss": loss})
    batch = ro.prompts_per_step * ro.group_size
    if scale.enabled:  # trainer ranks (with Ray, the engines too) in other processes
        actor, rollout = scale_out.build(scale, config, policy, tokenizer, batch)
    else:
        actor = TrainingEngine(policy, tokenizer, engine_config)  # a fresh optimizer for RL
        rollout = EmbeddedEngine(copy.deepcopy(policy), tokenizer, max_running=batch)
    keep_reference = algo.kl_coef > 0 or run.log_kl
    # the reference never steps: no optimizer state
    frozen = EngineConfig(device=m.device, share_prefixes=algo.share_prefixes)
    reference = TrainingEngine(copy.deepcopy(policy), None, frozen) if keep_reference else None
    critic = _critic(config, policy)
    colocation = _colocation(config, actor, rollout)

    log = MetricsLog(out / "metrics.jsonl")
    params = SamplingParams(
        max_tokens=ro.max_tokens,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=ro.top_k,
        return_sampling_mask=ro.top_p < 1.0 or ro.top_k > 0,  # replay the kept sets
        return_routed_experts=bool(find_routers(policy)),  # MoE: replay the routes (R3)
    )
    evaluate_now = functools.partial(
        evaluate, rollout, tokenizer, task, held_out, params, t.eval_samples
    )
    before = accuracy = evaluate_now()
    log.write(0, before)
    bar = tqdm(range(1, run.steps + 1), desc="rl", disable=not run.progress)
    for step in bar:
        tick = time.perf_counter()
        # 1-2. generate and reward
        problems = task.sample(ro.prompts_per_step, rng)
        step_params = dataclasses.replace(params, seed=run.seed * 1_000_003 + step)
        episodes = generate_episodes(rollout, tokenizer, problems, ro.group_size, step_params, task)
        gen_seconds = time.perf_counter() - tick
        if colocation is not None:
            colocation.after_generate()
        metrics = _episode_metrics(episodes, gen_seconds)
        kl = _kl_to_reference(reference, episodes, ro.temperature)
        if kl is not None:
            metrics["kl:mean"] = float(torch.cat(kl).mean())
        # 3-4. critic values and advantages
        values = critic.values([e.datum({}) for e in episodes]) if critic else None
        advantages, returns = _advantages(config, episodes, values, kl)
        # 5. train the critic
        if critic is not None:
            metrics |= _train_critic(config, critic, episodes, values, returns)
        # 6. train the actor (after the critic-only warm-up)
        if step > config.critic.warmup_steps or critic is None:
            metrics |= _train_actor(config, actor, episodes, advantages)
        # 7. publish the new weights to the rollout engine
        publish = functools.partial(_publish, actor, rollout, step)
        if colocation is not None:
            colocation.publish(publish)
            metrics |= colocation.ledger.peaks()
        else:
            publish()
        metrics |= scale_out.step_metrics(rollout)
        # 8. evaluate
        if step % run.eval_every == 0 or step == run.steps:
            accuracy = evaluate_now()
            metrics |= accuracy
        metrics["step_seconds"] = time.perf_counter() - tick
        log.write(step, metrics)
        bar.set_postfix(reward=f"{metrics['reward:mean']:.2f}", **_short(accuracy))

    plot_metrics(log.path, out / "curves.png", PLOTTED, title=f"furlong RL ({algo.advantage})")
    hf_dir = actor.export_hf(out / "policy") if run.export_hf else None
    scale_out.close(actor, rollout)
    return RunSummary(before, accuracy, run.steps, time.perf_counter() - start, out, hf_dir)


# ---------------------------------------------------------------- the parts


def _critic(config: RLConfig, policy: Any) -> Any:
    if not config.uses_critic:
        return None
    from furlong.models.critic import critic_from_policy
    from furlong.train.critic_engine import CriticConfig, CriticEngine

    model = critic_from_policy(policy, seed=config.run.seed)
    model = model.to(config.model.device)
    return CriticEngine(
        model, CriticConfig(value_clip=config.critic.value_clip, device=config.model.device)
    )


def _colocation(config: RLConfig, actor: TrainingEngine, rollout: EmbeddedEngine) -> Any:
    if not config.colocate.enabled:
        return None
    from furlong.rl.handoff import Colocation

    colocation = Colocation(actor, rollout, config.handoff(), has_critic=config.uses_critic)
    colocation.startup(lambda: None, functools.partial(_publish, actor, rollout, 0))
    return colocation


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _short(accuracy: dict[str, float]) -> dict[str, str]:
    return {k.removeprefix("eval_"): f"{v:.2f}" for k, v in accuracy.items()}


def _publish(actor: TrainingEngine, rollout: EmbeddedEngine, version: int) -> None:
    if not isinstance(actor, TrainingEngine):  # a trainer group: rank 0 gathers the weights
        return scale_out.publish(actor, rollout, version)
    from furlong.rl.handoff import trainer_weights  # the host copy while the trainer sleeps

    rollout.update_weights(trainer_weights(actor), version)


def _episode_metrics(episodes: list[Episode], seconds: float) -> dict[str, float]:
    tokens = sum(len(e.response) for e in episodes)
    sampled = torch.cat([torch.tensor(e.result.output_logprobs) for e in episodes])
    return {
        "reward:mean": sum(e.reward for e in episodes) / len(episodes),
        "response_tokens:mean": tokens / len(episodes),
        # -E[log p(sampled token)] estimates the sampling distribution's entropy
        "entropy:mean": float(-sampled.mean()),
        "rollout_tokens_per_s": tokens / max(seconds, 1e-9),
    }


def _kl_to_reference(
    reference: TrainingEngine | None, episodes: list[Episode], temperature: float
) -> list[torch.Tensor] | None:
    """Per response token ``log p_sampler - log p_ref`` (the k1 estimator). The reference is
    scored over the rollout's kept sets, like the actor, so truncation is not counted as KL;
    it routes MoE tokens itself (it is a different model from the one that sampled)."""
    if reference is None:
        return None
    data = [e.datum({"weights": torch.zeros(len(e.response))}) for e in episodes]
    masks = [e.result.sampling_mask for e in episodes]
    with torch.no_grad():
        out = reference.forward(
            data,
            "cross_entropy",
            temperature=temperature or 1.0,
            sampling_masks=masks if any(m is not None for m in masks) else None,
        )
    return [
        torch.tensor(e.result.output_logprobs) - o["logprobs"][-len(e.response) :]
        for e, o in zip(episodes, out.outputs, strict=True)
    ]


def _advantages(
    config: RLConfig,
    episodes: list[Episode],
    values: list[torch.Tensor] | None,
    kl: list[torch.Tensor] | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    algo = config.algo
    lengths = [len(e.response) for e in episodes]
    if algo.advantage == "grpo":
        rewards = torch.tensor([e.reward for e in episodes])
        group = config.rollout.group_size
        return adv.grpo(rewards, lengths, group, algo.scale_by_std, kl, algo.kl_coef), None
    token_rewards = [
        adv.token_rewards(e.reward, n, None if kl is None else kl[i], algo.kl_coef)
        for i, (e, n) in enumerate(zip(episodes, lengths, strict=True))
    ]
    if algo.advantage == "reinforce_pp":
        return adv.reinforce_pp(token_rewards, algo.gamma), None
    assert values is not None
    pairs = [
        adv.gae(r, v[-n:], algo.gamma, algo.lam)
        for r, v, n in zip(token_rewards, values, lengths, strict=True)
    ]
    return [a for a, _ in pairs], [g for _, g in pairs]


def _token_scale(config: RLConfig, lengths: list[int]) -> list[float]:
    """The loop's normalization, applied as per-token weights (the engine sums raw)."""
    if config.algo.normalize == "token":
        return [1.0 / sum(lengths)] * len(lengths)
    return [1.0 / (n * len(lengths)) for n in lengths]


def _minibatches(config: RLConfig, n: int) -> list[range]:
    size = n // config.algo.minibatches
    return [range(i, i + size) for i in range(0, n, size)]


def _train_actor(
    config: RLConfig, actor: TrainingEngine, episodes: list[Episode], advantages: list
) -> dict[str, float]:
    algo, ro = config.algo, config.rollout
    adam = AdamParams(learning_rate=algo.learning_rate, grad_clip_norm=algo.grad_clip_norm)
    metrics: dict[str, float] = {"actor_skipped:sum": 0.0}
    for part in _minibatches(config, len(episodes)):
        if not any(bool(advantages[i].any()) for i in part):
            # no learning signal (e.g. every group all right or all wrong): a zero gradient
            # would still move Adam's parameters through its momentum, so take no step
            metrics["actor_skipped:sum"] += 1
            continue
        chosen = [episodes[i] for i in part]
        scale = _token_scale(config, [len(e.response) for e in chosen])
        data = [
            e.datum(
                {
                    "logprobs": torch.tensor(e.result.output_logprobs),
                    "advantages": advantages[i] * s,
                }
            )
            for i, e, s in zip(part, chosen, scale, strict=True)
        ]
        masks = [e.result.sampling_mask for e in chosen]
        routes = [e.result.routed_experts for e in chosen]
        out = actor.forward_backward(
            data,
            algo.objective,
            config.loss_fn_config,
            temperature=ro.temperature or 1.0,
            sampling_masks=masks if any(m is not None for m in masks) else None,
            routed_experts=routes if any(r is not None for r in routes) else None,
        )
        if "logprob_diff:mean" not in metrics:  # first minibatch: the trainer is on-policy
            metrics["logprob_diff:mean"] = _logprob_diff(chosen, out.outputs)
        step = actor.optim_step(adam)
        metrics["actor_loss:sum"] = metrics.get("actor_loss:sum", 0.0) + out.metrics["loss:sum"]
        metrics["grad_norm:mean"] = step["grad_norm:mean"]
    return metrics


def _logprob_diff(episodes: list[Episode], outputs: list[dict[str, torch.Tensor]]) -> float:
    """Mean |trainer - rollout| log-prob of the sampled tokens: the train/inference mismatch
    (fp32 on one device: ~1e-6; a jump means the two sides score different distributions)."""
    diffs = [
        (o["logprobs"][-len(e.response) :] - torch.tensor(e.result.output_logprobs)).abs()
        for e, o in zip(episodes, outputs, strict=True)
    ]
    return float(torch.cat(diffs).mean())


def _train_critic(
    config: RLConfig,
    critic: Any,
    episodes: list[Episode],
    values: list[torch.Tensor] | None,
    returns: list[torch.Tensor] | None,
) -> dict[str, float]:
    assert values is not None and returns is not None
    adam = AdamParams(learning_rate=config.critic.learning_rate)
    metrics: dict[str, float] = {}
    for part in _minibatches(config, len(episodes)):
        chosen = [episodes[i] for i in part]
        scale = _token_scale(config, [len(e.response) for e in chosen])
        data = [e.datum({}) for e in chosen]
        pad = [len(d) - len(e.response) for d, e in zip(data, chosen, strict=True)]
        full = [torch.cat([torch.zeros(p), returns[i]]) for p, i in zip(pad, part, strict=True)]
        old = [values[i] for i in part]
        weights = [
            torch.cat([torch.zeros(p), torch.full((len(e.response),), s)])
            for p, e, s in zip(pad, chosen, scale, strict=True)
        ]
        metrics |= critic.forward_backward(data, full, old, weights)
        critic.optim_step(adam)
    return metrics
