"""``furlong eval``: score a model on a task, with the RL loop's own evaluation
(``furlong.rl.evaluation``) on the held-out split the loop would use.

A model is a preset (``smollm2-135m``), an HF directory, a run directory (its exported
``policy/``, else its latest checkpoint) or one checkpoint inside a run. The task and sampling
settings come from ``--config FILE``, else from the run's own ``config.toml``, else the
defaults; ``group.field=value`` overrides go on top (``task.name=reasoning_gym:chain_sum``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from furlong.atomic import atomic_write_text
from furlong.errors import InputError

if TYPE_CHECKING:
    from furlong.rl.config import RLConfig
    from furlong.rl.evaluation import Evaluation, Reply
    from furlong.rollout.base import RolloutEngine

BATCH = 64  # the embedded engine's slots


@dataclass(frozen=True)
class Scored:
    model: str
    evaluation: Evaluation
    seconds: float

    def summary(self) -> dict[str, Any]:
        return {"model": self.model, "seconds": round(self.seconds, 1), **self.evaluation.metrics}


def run_config(model: str, config_file: str | None, overrides: Sequence[str]) -> RLConfig:
    """The settings ``model`` is scored under (see the module's docstring)."""
    from furlong.rl.config import load_config

    if config_file is None:
        own = _run_config_file(Path(model))
        if own is not None:
            return load_config(own, overrides)
        return load_config(None, [f"model.name={json.dumps(model)}", *overrides])
    return load_config(config_file, overrides)


def _run_config_file(path: Path) -> Path | None:
    """A run directory's or a checkpoint's ``config.toml`` (an HF directory has none)."""
    own = path / "config.toml"
    return own if own.is_file() else None


@dataclass
class Loaded:
    rollout: RolloutEngine
    tokenizer: Any
    policy: Any  # the model as loaded (its routers say whether routes are asked for)


def load(model: str, config: RLConfig) -> Loaded:
    """An embedded engine holding ``model``'s weights."""
    from furlong.rl.build import load_policy
    from furlong.rl.rollout_choice import build_rollout

    path = Path(model)
    if (path / "state.json").is_file() or (
        (path / "checkpoints").is_dir() and not (path / "policy" / "config.json").is_file()
    ):
        return _checkpoint(path)
    if (path / "config.toml").is_file():  # a finished run: its exported policy
        if not (path / "policy" / "config.json").is_file():
            raise InputError(f"model: run directory {model} has neither policy/ nor checkpoints/")
        model = str(path / "policy")
    policy, tokenizer = load_policy(model, config.model)
    return Loaded(build_rollout("embedded", [], policy, tokenizer, BATCH), tokenizer, policy)


def _checkpoint(path: Path) -> Loaded:
    """The actor of a checkpoint (every weight or a LoRA adapter), loaded as the loop does on
    resume and published to a fresh engine."""
    from furlong.rl import resume
    from furlong.rl.build import load_policy, trainer_for
    from furlong.rl.publish import publish_weights
    from furlong.rl.rollout_choice import build_rollout
    from furlong.train.engine import EngineConfig

    saved = resume.find_checkpoint(path)
    cfg = saved.config
    policy, tokenizer = load_policy(resume.model_source(saved, cfg.model.name), cfg.model)
    actor = trainer_for(cfg, policy, tokenizer, EngineConfig(device=cfg.model.device))
    resume.restore_actor(saved, actor)
    rollout = build_rollout("embedded", [], policy, tokenizer, BATCH)
    publish_weights(actor, rollout, saved.weight_version)
    actor.close()
    return Loaded(rollout, tokenizer, policy)


def score(
    model: str,
    config: RLConfig,
    samples: int | None = None,
    pass_k: int | None = None,
    seed: int = 0,
) -> Scored:
    """``model`` on ``config``'s task: the loop's held-out problems and evaluation
    (``samples`` / ``pass_k`` default to ``task.eval_samples`` / ``task.eval_pass_k``)."""
    import dataclasses

    from furlong.rl.build import sampling_params
    from furlong.rl.evaluation import SAMPLED_SEED, evaluate
    from furlong.rl.task_sources import held_out, make_task

    t = config.task
    samples = t.eval_samples if samples is None else samples
    if pass_k is None:  # the config's, where the draws allow it
        pass_k = t.eval_pass_k if t.eval_pass_k <= samples else 0
    if pass_k > max(samples, 1):
        raise InputError(f"--pass-k: {pass_k} needs --samples >= it (got {samples})")
    task = make_task(t)
    start = time.perf_counter()
    loaded = load(model, config)
    params = sampling_params(config, loaded.policy)
    params = dataclasses.replace(params, return_routed_experts=False)
    problems = held_out(task, config.task)
    evaluation = evaluate(
        loaded.rollout,
        loaded.tokenizer,
        task,
        problems,
        params,
        samples,
        pass_k,
        SAMPLED_SEED + seed,
    )
    loaded.rollout.close()
    return Scored(model, evaluation, time.perf_counter() - start)


# ------------------------------------------------------------------ what it prints


def table(scored: Sequence[Scored]) -> str:
    """A Markdown table: one row per model, one column per metric."""
    keys = list(dict.fromkeys(k for s in scored for k in s.evaluation.metrics))
    names = [k.removeprefix("eval_") for k in keys]
    lines = ["| model | " + " | ".join(names) + " | seconds |"]
    lines.append("|---|" + "---:|" * (len(keys) + 1))
    for s in scored:
        values = [
            f"{s.evaluation.metrics[k]:.1%}" if k in s.evaluation.metrics else "" for k in keys
        ]
        lines.append(f"| {s.model} | " + " | ".join(values) + f" | {s.seconds:.0f} |")
    return "\n".join(lines)


def side_by_side(scored: Sequence[Scored], count: int) -> str:
    """The first ``count`` held-out problems: each model's greedy reply, with its verdict."""
    greedy = [[r for r in s.evaluation.replies if r.mode == "greedy"] for s in scored]
    blocks = []
    for i in range(min(count, min(map(len, greedy)))):
        first = greedy[0][i]
        lines = [f"{first.prompt!r}  (answer: {first.reference})"]
        for s, replies in zip(scored, greedy, strict=True):
            lines.append(f"  {_mark(replies[i])} {s.model}: {replies[i].completion!r}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _mark(reply: Reply) -> str:
    return "ok " if reply.correct >= 1.0 else "-- " if reply.correct <= 0.0 else "~  "


def report(scored: Sequence[Scored], config: RLConfig) -> dict[str, Any]:
    """What ``--out`` holds: the task, each model's metrics and every reply."""
    import dataclasses

    return {
        "task": dataclasses.asdict(config.task),
        "rollout": {
            "max_tokens": config.rollout.max_tokens,
            "temperature": config.rollout.temperature,
        },
        "models": [
            s.summary() | {"replies": [dataclasses.asdict(r) for r in s.evaluation.replies]}
            for s in scored
        ],
    }


def write_report(path: str | Path, data: dict[str, Any]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(data, indent=1) + "\n")
    return out


def show_samples(
    run: str | Path, step: int | None, mode: str | None, wrong: bool, limit: int
) -> str:
    """The replies a run's ``samples.jsonl`` holds (default: its latest evaluation's)."""
    from furlong.rl.samples_log import FILE, read_samples

    path = Path(run) / FILE
    if not path.is_file():
        raise InputError(f"--show: {path} is missing (a run writes it at each evaluation)")
    rows = list(read_samples(path))
    if step is None:
        evals = [r["step"] for r in rows if r["mode"] != "train"]
        step = evals[-1] if evals else None
    rows = [r for r in rows if r["step"] == step and (mode is None or r["mode"] == mode)]
    if wrong:
        rows = [r for r in rows if r["correct"] < 1.0]
    lines = [f"{path}: step {step}, {len(rows)} replies" + (" (wrong ones)" if wrong else "")]
    for r in rows[:limit]:
        stop = "" if r["stopped"] else "  [cut at max_tokens]"
        lines.append(
            f"- [{r['mode']}] {r['prompt']!r}\n    answer {r['reference']!r}, took "
            f"{r['extracted']!r}, correct {r['correct']:g}, reward {r['reward']:g}{stop}\n"
            f"    {r['completion']!r}"
        )
    return "\n".join(lines)
