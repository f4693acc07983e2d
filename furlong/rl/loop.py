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

from furlong import host_memory
from furlong.errors import InputError
from furlong.metrics import MetricsLog, Tracker, WandbSettings, plot_metrics, read_metrics
from furlong.models.loading import load_model
from furlong.models.moe import find_routers
from furlong.rl import advantages as adv
from furlong.rl import resume as resume_mod
from furlong.rl import scale_out
from furlong.rl.config import RLConfig, to_toml
from furlong.rl.episodes import Episode, generate_episodes
from furlong.rl.publish import publish_weights
from furlong.rl.rollout_choice import build_rollout
from furlong.rl.scale_out import ScaleOut
from furlong.rl.signal_watch import SignalWatch
from furlong.rl.tasks import build_task
from furlong.rl.warmup import evaluate, supervised_warmup
from furlong.rollout.base import RolloutEngine
from furlong.rollout.sampling import SamplingParams
from furlong.train.api import Trainer
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


def train(
    config: RLConfig, scale: ScaleOut | None = None, resume: str | Path | None = None
) -> RunSummary:
    """``scale``: trainer ranks and Ray placement (``furlong.rl.scale_out``); default: the
    config's ``[scale]`` group (one process). ``resume``: a checkpoint directory, or a run's
    ``out_dir`` (its latest checkpoint), to continue bit-identically (``furlong.rl.resume``)."""
    config.validate()
    host_memory.keep_freed_blocks()  # a step's activations reuse the last step's heap pages
    scale = scale or config.scale
    scale.check(config.colocate.enabled)
    saved = resume_mod.prepare(config, scale, resume)  # None: a fresh run
    start = time.perf_counter()
    run, ro, algo = config.run, config.rollout, config.algo
    out = Path(run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if saved is None:
        resume_mod.forget_latest(out)
    tracker = Tracker(
        out,
        tensorboard=run.tensorboard,
        wandb=WandbSettings(enabled=run.wandb, project=run.wandb_project),
    )
    log, rows = _metrics_log(out, saved, tracker)  # before anything is written: may refuse
    _write_atomic(out / "config.toml", to_toml(config))  # `furlong train` reruns it
    rng = random.Random(run.seed)
    torch.manual_seed(run.seed)

    m = config.model
    engine_config = EngineConfig(
        device=m.device, optimizer=config.optimizer, share_prefixes=algo.share_prefixes
    )
    source = resume_mod.model_source(saved, m.name)  # a LoRA run's warmed-up base on resume
    policy, tokenizer = load_model(source, seed=m.seed, dtype=getattr(torch, m.dtype))
    policy = policy.to(m.device)
    t = config.task
    task = build_task(t.name, t.reward, t.path, t.max_a, t.max_b)
    held_out = task.eval[: t.eval_size] if t.eval_size else task.eval
    if config.warmup.steps and saved is None:  # a resumed run has its warm-up in the checkpoint
        warmup = TrainingEngine(policy, tokenizer, engine_config)
        losses = supervised_warmup(warmup, task, config.warmup, rng, run.progress)
        warm_log = MetricsLog(out / "warmup.jsonl", tracker=tracker)
        for i, loss in enumerate(losses, 1):
            warm_log.write(i, {"loss": loss})
    batch = ro.prompts_per_step * ro.group_size
    if scale.enabled:  # trainer ranks (with Ray, the engines too) in other processes
        actor, rollout = scale_out.build(scale, config, policy, tokenizer, batch)
    else:
        actor = _actor(config, policy, tokenizer, engine_config)  # a fresh optimizer for RL
        rollout = build_rollout(
            ro.engine, ro.urls, policy, tokenizer, batch, staging_dir=ro.staging_dir or None
        )
    keep_reference = algo.kl_coef > 0 or run.log_kl
    # the reference never steps: no optimizer state
    frozen = EngineConfig(device=m.device, share_prefixes=algo.share_prefixes)
    reference = TrainingEngine(copy.deepcopy(policy), None, frozen) if keep_reference else None
    critic = _critic(config, policy)
    if saved is not None:  # the copies above started from the model as loaded
        resume_mod.restore_reference(saved, reference)
        critic = resume_mod.restore_critic(
            saved, critic, lambda: _critic_from_actor(config, saved, policy)
        )
    colocation = _colocation(config, actor, rollout, saved)  # a colocated actor loads in there
    if saved is not None and colocation is None:
        resume_mod.restore_actor(saved, actor)
        publish_weights(actor, rollout, saved.weight_version)
    saved_reference = reference if config.warmup.steps else None  # else: the model as loaded
    # a LoRA checkpoint holds the adapter; the base it adapts is the model after the warm-up
    warmed_base = (policy, tokenizer) if m.lora_rank and config.warmup.steps else None

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
    if saved is None:
        before = accuracy = evaluate_now()
        log.write(0, before)
    else:  # the step-0 and latest evaluations are in the kept metrics
        before, accuracy = _evaluations(rows)
        resume_mod.restore_rng(saved, rng)  # last: the set-up above draws from torch's
    first = 0 if saved is None else saved.step
    bar = tqdm(
        range(first + 1, run.steps + 1),
        desc="rl",
        initial=first,
        total=run.steps,
        disable=not run.progress,
    )
    watch = SignalWatch(algo.minibatches)
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
        # a checkpoint's engines are written now, while a colocated trainer is awake
        pending = None
        if run.save_every and (step % run.save_every == 0 or step == run.steps):
            pending = resume_mod.stage(out, step, actor, critic, saved_reference, warmed_base)
        # 7. publish the new weights to the rollout engine
        publish = functools.partial(publish_weights, actor, rollout, step)
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
        watch.observe(metrics)
        if pending is not None:  # complete once its step's metrics line is in the file
            resume_mod.commit(pending, config, step, rng)
        bar.set_postfix(reward=f"{metrics['reward:mean']:.2f}", **_short(accuracy))

    watch.finish()
    warm_path = out / "warmup.jsonl"
    plot_metrics(
        log.path,
        out / "curves.png",
        PLOTTED,
        title=f"furlong RL ({algo.advantage})",
        warmup_jsonl=warm_path if warm_path.is_file() else None,
    )
    tracker.close()
    hf_dir = _export(actor, colocation, out / "policy") if run.export_hf else None
    if run.export_adapter:
        _export_adapter(actor, out / "policy_adapter")
    scale_out.close(actor, rollout)
    return RunSummary(before, accuracy, run.steps, time.perf_counter() - start, out, hf_dir)


# ---------------------------------------------------------------- resume and export


def _metrics_log(
    out: Path, saved: resume_mod.Checkpoint | None, tracker: Tracker
) -> tuple[MetricsLog, list]:
    """A fresh log; on resume, the log kept up to the checkpoint's step (a crash may have
    written later lines, which the resumed steps write again) and its rows."""
    path = out / "metrics.jsonl"
    if saved is None:
        return MetricsLog(path, tracker=tracker, prefix="rl"), []
    if not path.is_file():
        raise InputError(
            f"run.out_dir: {path} is missing; a resume appends to its run's metrics (set "
            f"run.out_dir to {saved.run_dir})"
        )
    log = MetricsLog(path, tracker=tracker, prefix="rl", resume_from_step=saved.step)
    return log, read_metrics(path)


def _evaluations(rows: list[dict[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """The step-0 evaluation and the latest one, from the metrics rows."""
    evals = [{k: v for k, v in r.items() if k.startswith("eval_")} for r in rows]
    evals = [e for e in evals if e]
    return (evals[0], evals[-1]) if evals else ({}, {})


def _critic_from_actor(config: RLConfig, saved: resume_mod.Checkpoint, policy: Any) -> Any:
    """A fresh critic on the checkpoint's actor weights (``policy``: a model of its shape)."""
    return _critic(config, resume_mod.actor_model(saved, policy))


def _export(actor: Trainer, colocation: Any, path: Path) -> Path:
    if colocation is not None:  # the last publish left the trainer asleep
        colocation.finish()
    return actor.export_hf(path)


# ---------------------------------------------------------------- the parts


ADAPTER = "actor"  # the peft adapter's name in a LoRA run


def _actor(
    config: RLConfig, policy: Any, tokenizer: Any, engine_config: EngineConfig
) -> TrainingEngine:
    """The trainer: every weight of the policy, or (``model.lora_rank``) a LoRA adapter on a
    weight-sharing view of it, built by the same code as the Tinker service's adapters."""
    m = config.model
    if not m.lora_rank:
        return TrainingEngine(policy, tokenizer, engine_config)
    from furlong.train import lora

    spec = lora.LoraSpec(
        rank=m.lora_rank, train_mlp=m.lora_mlp, train_attn=m.lora_attn, train_unembed=m.lora_unembed
    )
    peft = lora.add_adapter(None, policy, ADAPTER, lora.peft_config(policy, spec), config.run.seed)
    return TrainingEngine(
        peft,
        tokenizer,
        engine_config,
        trainable=lora.adapter_params(peft, ADAPTER),
        merged=functools.partial(lora.merged_model, peft),
    )


def _export_adapter(actor: TrainingEngine, path: Path) -> Path:
    from furlong.models.loading import atomic_dir, publish_dir
    from furlong.train import lora

    tmp, final = atomic_dir(path)
    lora.save_adapter(tmp, actor.model, ADAPTER)
    publish_dir(tmp, final)
    return final


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


def _colocation(
    config: RLConfig,
    actor: TrainingEngine,
    rollout: RolloutEngine,
    saved: resume_mod.Checkpoint | None,
) -> Any:
    if not config.colocate.enabled:
        return None
    from furlong.rl.handoff import Colocation

    colocation = Colocation(actor, rollout, config.handoff(), has_critic=config.uses_critic)
    if saved is None:
        load, version = (lambda: None), 0
    else:  # the contract's "trainer init + checkpoint load"
        load = functools.partial(resume_mod.restore_actor, saved, actor)
        version = saved.weight_version
    colocation.startup(load, functools.partial(publish_weights, actor, rollout, version))
    return colocation


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _short(accuracy: dict[str, float]) -> dict[str, str]:
    return {k.removeprefix("eval_"): f"{v:.2f}" for k, v in accuracy.items()}


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
    config: RLConfig, actor: Trainer, episodes: list[Episode], advantages: list
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
