"""The RL loop, top to bottom:

    generate → reward → critic values → advantages → train critic → train actor → publish → eval

Every loss goes through a TrainingEngine (the actor's objective is the same code the Tinker
service runs); generation goes through a rollout engine holding its own copy of the weights,
refreshed by ``update_weights`` after each step, as on a real cluster. The parts it drives are
built by ``furlong.rl.build``.

Shape suffixes: ``_T`` an episode's response tokens, ``_S`` its datum's positions (prompt +
response, less one), ``_B`` the step's episodes; a list of per-episode tensors takes its
tensors' suffix (``advantages_T[i]`` is episode ``i``'s).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from furlong import host_memory
from furlong.atomic import atomic_write_text
from furlong.errors import InputError
from furlong.metrics import (
    Heartbeat,
    MetricsLog,
    Tracker,
    WandbSettings,
    plot_metrics,
    read_metrics,
)
from furlong.rl import advantages as adv
from furlong.rl import resume as resume_mod
from furlong.rl.build import ADAPTER, Parts, build_parts
from furlong.rl.config import RLConfig, RunConfig, to_toml
from furlong.rl.critic import critic_values, train_critic
from furlong.rl.episodes import Episode, generate_episodes
from furlong.rl.evaluation import Reply
from furlong.rl.publish import publish_weights
from furlong.rl.rollout_correction import truncated_is
from furlong.rl.samples_log import FILE as SAMPLES
from furlong.rl.samples_log import SamplesLog
from furlong.rl.scale import ScaleOut
from furlong.rl.signal_watch import SignalWatch
from furlong.train.api import Trainer
from furlong.train.engine import TrainingEngine
from furlong.types import AdamParams

if TYPE_CHECKING:
    from peft import PeftModel

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
    config: RLConfig,
    scale: ScaleOut | None = None,
    resume: str | Path | None = None,
    parts: Parts | None = None,
) -> RunSummary:
    """``scale``: trainer ranks and Ray placement (``furlong.rl.scale_out``); default: the
    config's ``[scale]`` group (one process). ``resume``: a checkpoint directory, or a run's
    ``out_dir`` (its latest checkpoint), to continue bit-identically (``furlong.rl.resume``).
    ``parts``: what ``build_parts(config, scale, checkpoint)`` returns; default: built here."""
    config.validate()
    host_memory.keep_freed_blocks()  # a step's activations reuse the last step's heap pages
    scale = scale or config.scale
    scale.check(config.colocate.enabled)
    saved = resume_mod.prepare(config, scale, resume)  # None: a fresh run
    start = time.perf_counter()
    run, ro = config.run, config.rollout
    out, tracker, log, rows = _open_run(config, saved)
    said = SamplesLog(out / SAMPLES, None if saved is None else saved.step)
    if parts is None:
        parts = _build_and_warm_up(config, scale, saved, out, tracker)
    else:  # built (and warmed up) by the caller: its losses are logged now
        _log_warmup(out, tracker, parts.warmup_losses)
    if saved is None:
        before = accuracy = _evaluate(config, parts, said, 0)
        log.write(0, before)
    else:  # the step-0 and latest evaluations are in the kept metrics
        before, accuracy = _evaluations(rows)
    bar = _steps(run, 0 if saved is None else saved.step)
    heartbeat = (
        None if run.progress else Heartbeat("rl", run.steps)
    )  # bars off: a line now and then
    watch = SignalWatch(config.algo.minibatches)
    for step in bar:
        tick = time.perf_counter()
        episodes, metrics = _generate(config, parts, step)  # 1-2. generate and reward
        if run.samples_every and step % run.samples_every == 0:
            said.write(step, [Reply.of("train", e) for e in episodes])
        kl_T = _kl_to_reference(parts.reference, episodes, ro.temperature)
        if kl_T is not None:
            metrics["kl:mean"] = float(torch.cat(kl_T).mean())
        values_S = _critic_values(parts.critic, episodes)  # 3-4. critic values and advantages
        advantages_T, returns_T = _advantages(config, episodes, values_S, kl_T)
        if parts.critic is not None:  # 5. train the critic
            metrics |= _train_critic(config, parts.critic, episodes, values_S, returns_T)
        if step > config.critic.warmup_steps or parts.critic is None:  # 6. (after its warm-up)
            metrics |= _train_actor(config, parts.actor, episodes, advantages_T)
        pending = _stage_checkpoint(config, parts, out, step)  # the trainer is awake now
        metrics |= _publish(parts, step)  # 7. the new weights to the rollout engine
        if step % run.eval_every == 0 or step == run.steps:  # 8. evaluate
            metrics |= (accuracy := _evaluate(config, parts, said, step))
        metrics["step_seconds"] = time.perf_counter() - tick
        log.write(step, metrics)
        watch.observe(metrics)
        if pending is not None:  # complete once its step's metrics line is in the file
            resume_mod.commit(pending, config, step, parts.rng)
        bar.set_postfix(reward=f"{metrics['reward:mean']:.2f}", **_short(accuracy))
        if heartbeat is not None:
            heartbeat.tick(step, f"reward {metrics['reward:mean']:.2f}")
    watch.finish()
    _plot(config, out, log)
    tracker.close()
    hf_dir = _export(parts, out / "policy") if run.export_hf else None
    if run.export_adapter and parts.adapter is not None:
        _export_adapter(parts.adapter, out / "policy_adapter", _adapter_base(config, parts, out))
    parts.rollout.close()  # first: Ray trainer ranks release the placement group it is on
    parts.actor.close()
    return RunSummary(before, accuracy, run.steps, time.perf_counter() - start, out, hf_dir)


# ---------------------------------------------------------------- the run's files


def _open_run(
    config: RLConfig, saved: resume_mod.Checkpoint | None
) -> tuple[Path, Tracker, MetricsLog, list[dict[str, float]]]:
    """The run's directory, its trackers, its metrics log with the rows kept (on resume) and
    its ``config.toml`` (``furlong train`` reruns it)."""
    run = config.run
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
    atomic_write_text(out / "config.toml", to_toml(config))
    return out, tracker, log, rows


def _metrics_log(
    out: Path, saved: resume_mod.Checkpoint | None, tracker: Tracker
) -> tuple[MetricsLog, list[dict[str, float]]]:
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


def _evaluate(config: RLConfig, parts: Parts, said: SamplesLog, step: int) -> dict[str, float]:
    """The held-out evaluation's metrics; its replies go to ``samples.jsonl``."""
    t = config.task
    evaluation = parts.evaluate(t.eval_samples, t.eval_pass_k)
    said.write(step, evaluation.replies)
    return evaluation.metrics


def _evaluations(rows: list[dict[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """The step-0 evaluation and the latest one, from the metrics rows."""
    evals = [{k: v for k, v in r.items() if k.startswith("eval_")} for r in rows]
    evals = [e for e in evals if e]
    return (evals[0], evals[-1]) if evals else ({}, {})


def _export(parts: Parts, path: Path) -> Path:
    if parts.colocation is not None:  # the last publish left the trainer asleep
        parts.colocation.finish()
    return parts.actor.export_hf(path)


def _adapter_base(config: RLConfig, parts: Parts, out: Path) -> str:
    """The exported adapter's base: ``model.name``, as the user named it. After a warm-up the
    adapter sits on the warmed-up weights, which no name loads: they are exported beside it as
    ``policy_base/`` (an HF directory), named by its absolute path. RL never changed them: the
    adapter trains on a weight-sharing view, and the rollout merges into copies."""
    if parts.warmed_base is None:
        return config.model.name
    from furlong.models.loading import save_hf_dir

    return str(save_hf_dir(*parts.warmed_base, out / "policy_base").resolve())


def _export_adapter(adapter: PeftModel, path: Path, base_model: str) -> Path:
    from furlong.models.loading import atomic_dir, publish_dir
    from furlong.train import lora

    tmp, final = atomic_dir(path)
    lora.save_adapter(tmp, adapter, ADAPTER, base_model)
    publish_dir(tmp, final)
    return final


def _plot(config: RLConfig, out: Path, log: MetricsLog) -> None:
    warm_path = out / "warmup.jsonl"
    plot_metrics(
        log.path,
        out / "curves.png",
        PLOTTED,
        title=f"furlong RL ({config.algo.advantage})",
        warmup_jsonl=warm_path if warm_path.is_file() else None,
    )


def _build_and_warm_up(
    config: RLConfig,
    scale: ScaleOut,
    saved: resume_mod.Checkpoint | None,
    out: Path,
    tracker: Tracker,
) -> Parts:
    """The parts; the warm-up's steps land in ``warmup.jsonl`` (and TensorBoard) as they
    finish, so a crash or a reader mid-run sees them. A resumed run keeps its file."""
    if not config.warmup.steps or saved is not None:
        return build_parts(config, scale, saved)
    warm_log = MetricsLog(out / "warmup.jsonl", tracker=tracker)
    try:
        return build_parts(config, scale, saved, warmup_log=warm_log)
    finally:
        warm_log.close()


def _log_warmup(out: Path, tracker: Tracker, losses: list[float]) -> None:
    if not losses:  # no warm-up, or a resumed run's (its file is kept)
        return
    warm_log = MetricsLog(out / "warmup.jsonl", tracker=tracker)
    for i, loss in enumerate(losses, 1):
        warm_log.write(i, {"loss": loss})


def _steps(run: RunConfig, first: int) -> tqdm:
    """The steps after ``first`` (a resumed run's checkpoint), with a progress bar."""
    steps = range(first + 1, run.steps + 1)
    return tqdm(steps, desc="rl", initial=first, total=run.steps, disable=not run.progress)


def _short(accuracy: dict[str, float]) -> dict[str, str]:
    return {k.removeprefix("eval_"): f"{v:.2f}" for k, v in accuracy.items()}


# ---------------------------------------------------------------- one step


def _generate(config: RLConfig, parts: Parts, step: int) -> tuple[list[Episode], dict[str, float]]:
    """1-2. ``rollout.group_size`` rewarded responses to each of the step's problems (then,
    colocated, the device goes to the trainer), and their metrics."""
    tick = time.perf_counter()
    ro = config.rollout
    problems = parts.task.sample(ro.prompts_per_step, parts.rng)
    params = dataclasses.replace(parts.params, seed=config.run.seed * 1_000_003 + step)
    episodes = generate_episodes(
        parts.rollout, parts.tokenizer, problems, ro.group_size, params, parts.task
    )
    seconds = time.perf_counter() - tick
    if parts.colocation is not None:
        parts.colocation.after_generate()
    return episodes, _episode_metrics(episodes, seconds)


def _episode_metrics(episodes: list[Episode], seconds: float) -> dict[str, float]:
    tokens = sum(len(e.response) for e in episodes)
    sampled = torch.cat([e.logprobs_T for e in episodes])
    return {
        "reward:mean": sum(e.reward for e in episodes) / len(episodes),
        "correct:mean": sum(e.correct for e in episodes) / len(episodes),  # the verifier alone
        "stopped:mean": sum(e.result.finish_reason == "stop" for e in episodes) / len(episodes),
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
        e.logprobs_T - o["logprobs"][-len(e.response) :]
        for e, o in zip(episodes, out.outputs, strict=True)
    ]


def _critic_values(
    critic: TrainingEngine | None, episodes: list[Episode]
) -> list[torch.Tensor] | None:
    """3. The critic's value at every position of each episode's datum (None: no critic)."""
    return critic_values(critic, episodes) if critic is not None else None


def _advantages(
    config: RLConfig,
    episodes: list[Episode],
    values_S: list[torch.Tensor] | None,
    kl_T: list[torch.Tensor] | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """4. Per episode, every response token's advantage and (GAE) the critic's target."""
    algo = config.algo
    lengths = [len(e.response) for e in episodes]
    if algo.advantage == "grpo":
        rewards_B = torch.tensor([e.reward for e in episodes])
        group = config.rollout.group_size
        return adv.grpo(rewards_B, lengths, group, algo.scale_by_std, kl_T, algo.kl_coef), None
    rewards_T = [
        adv.token_rewards(e.reward, n, None if kl_T is None else kl_T[i], algo.kl_coef)
        for i, (e, n) in enumerate(zip(episodes, lengths, strict=True))
    ]
    if algo.advantage == "reinforce_pp":
        return adv.reinforce_pp(rewards_T, algo.gamma), None
    assert values_S is not None
    pairs = [
        adv.gae(r, v[-n:], algo.gamma, algo.lam)
        for r, v, n in zip(rewards_T, values_S, lengths, strict=True)
    ]
    return [a for a, _ in pairs], [g for _, g in pairs]


def _token_scale(config: RLConfig, lengths: list[int]) -> list[float]:
    """The loop's normalization, applied as per-token weights (the engine sums raw)."""
    if config.algo.normalize == "token":
        return [1.0 / sum(lengths)] * len(lengths)
    return [1.0 / (n * len(lengths)) for n in lengths]


def _minibatches(config: RLConfig, episodes: list[Episode]) -> list[tuple[range, list[float]]]:
    """Each optimizer step's episodes (``algo.minibatches`` equal parts, in order) and their
    per-token loss scales."""
    n = len(episodes)
    size = n // config.algo.minibatches
    parts = [range(i, i + size) for i in range(0, n, size)]
    return [(p, _token_scale(config, [len(episodes[i].response) for i in p])) for p in parts]


def _train_critic(
    config: RLConfig,
    critic: TrainingEngine,
    episodes: list[Episode],
    values_S: list[torch.Tensor] | None,
    returns_T: list[torch.Tensor] | None,
) -> dict[str, float]:
    """5. The critic's value loss toward the returns, one optimizer step per minibatch."""
    assert values_S is not None and returns_T is not None
    plan = _minibatches(config, episodes)
    return train_critic(config, critic, episodes, values_S, returns_T, plan)


def _train_actor(
    config: RLConfig, actor: Trainer, episodes: list[Episode], advantages_T: list[torch.Tensor]
) -> dict[str, float]:
    """6. The actor's objective, one optimizer step per minibatch with a learning signal."""
    algo, ro = config.algo, config.rollout
    adam = AdamParams(learning_rate=algo.learning_rate, grad_clip_norm=algo.grad_clip_norm)
    metrics: dict[str, float] = {"actor_skipped:sum": 0.0}
    behaviour_T: list[torch.Tensor | None] = [None] * len(episodes)
    if algo.tis_cap:  # rollout correction: the trainer's own log-probs, and min(p / q, cap)
        trainer_T = _trainer_logprobs(config, actor, episodes)
        weights_T, tis = truncated_is(trainer_T, [e.logprobs_T for e in episodes], algo.tis_cap)
        advantages_T = [a * w for a, w in zip(advantages_T, weights_T, strict=True)]
        behaviour_T = list(trainer_T)
        metrics |= tis
    for part, scale in _minibatches(config, episodes):
        if not any(bool(advantages_T[i].any()) for i in part):
            # no learning signal (e.g. every group all right or all wrong): a zero gradient
            # would still move Adam's parameters through its momentum, so take no step
            metrics["actor_skipped:sum"] += 1
            continue
        chosen = [episodes[i] for i in part]
        data = [
            e.actor_datum(algo.objective, advantages_T[i] * s, behaviour_T[i])
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


def _trainer_logprobs(
    config: RLConfig, actor: Trainer, episodes: list[Episode]
) -> list[torch.Tensor]:
    """The trainer's log-prob of each sampled response token (no gradient), at the rollout's
    temperature and over its kept sets, as the objective scores them."""
    data = [e.datum({"weights": torch.zeros(len(e.response))}) for e in episodes]
    masks = [e.result.sampling_mask for e in episodes]
    routes = [e.result.routed_experts for e in episodes]
    with torch.no_grad():
        out = actor.forward(
            data,
            "cross_entropy",
            temperature=config.rollout.temperature or 1.0,
            sampling_masks=masks if any(m is not None for m in masks) else None,
            routed_experts=routes if any(r is not None for r in routes) else None,
        )
    return [
        o["logprobs"][-len(e.response) :].detach()
        for e, o in zip(episodes, out.outputs, strict=True)
    ]


def _logprob_diff(episodes: list[Episode], outputs: list[dict[str, torch.Tensor]]) -> float:
    """Mean |trainer - rollout| log-prob of the sampled tokens: the train/inference mismatch
    (fp32 on one device: ~1e-6; a jump means the two sides score different distributions)."""
    diffs_T = [
        (o["logprobs"][-len(e.response) :] - e.logprobs_T).abs()
        for e, o in zip(episodes, outputs, strict=True)
    ]
    return float(torch.cat(diffs_T).mean())


def _stage_checkpoint(
    config: RLConfig, parts: Parts, out: Path, step: int
) -> resume_mod.Pending | None:
    """On a checkpoint's step, its engines, written now, while a colocated trainer is awake
    (the loop commits it once the step's metrics line is in the file)."""
    run = config.run
    if not run.save_every or (step % run.save_every and step != run.steps):
        return None
    reference = parts.reference if config.warmup.steps else None  # else: the model as loaded
    return resume_mod.stage(out, step, parts.actor, parts.critic, reference, parts.warmed_base)


def _publish(parts: Parts, version: int) -> dict[str, float]:
    """7. The trainer's new weights to the rollout engine (colocated: around the hand-off);
    the hand-off's memory peaks and the rollout's own metrics."""
    publish = functools.partial(publish_weights, parts.actor, parts.rollout, version)
    if parts.colocation is None:
        publish()
        return parts.rollout.metrics()
    parts.colocation.publish(publish)
    return parts.colocation.ledger.peaks() | parts.rollout.metrics()
