"""RL step time: furlong's GRPO loop vs TRL's ``GRPOTrainer`` on the same model and workload.

One step = generate 16 prompts x 8 samples (128 completions, at most 6 new tokens, temperature
1) for the ``reverse`` task's prompts (3 digits, chat template), score them (``bench_spread``:
a deterministic score that varies between samples, so every step has a real update), GRPO advantages
(group std scaling, no KL), one forward/backward over the 128 completions and one AdamW step
(lr 1e-3, grad clip 1.0). Both sides start from the same ``small-qwen3`` HF directory (fp32,
CPU) and use the same number of intra-op threads. Each measurement runs in a fresh subprocess;
the first ``--warmup`` steps are dropped. furlong and TRL alternate over ``--rounds`` (the
order flips each round) and the median of per-round ratios (TRL s / furlong s, each the
median step time of its round) is reported. Target: >= 1.5x.

TRL is not a furlong dependency; install it for this benchmark only, e.g. in a scratch venv:

    python3.11 -m venv /tmp/trl-venv
    /tmp/trl-venv/bin/pip install -c constraints.txt torch==2.13.0
    /tmp/trl-venv/bin/pip install -c constraints.txt -e . trl==1.16.0

Run: ``/tmp/trl-venv/bin/python benchmarks/rl_step.py [--quick]``, or keep furlong's own venv
for the furlong side: ``.venv/bin/python benchmarks/rl_step.py --trl-python
/tmp/trl-venv/bin/python``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

TRL_VERSION = "1.16.0"  # the newest TRL that resolves against constraints.txt (transformers 5.24)
INSTALL_HINT = f"""TRL is not installed for {{python}}.
It is a benchmark-only dependency (not in pyproject.toml); install it in a scratch venv:

    python3.11 -m venv /tmp/trl-venv
    /tmp/trl-venv/bin/pip install -c constraints.txt torch==2.13.0
    /tmp/trl-venv/bin/pip install -c constraints.txt -e . trl=={TRL_VERSION}

then run /tmp/trl-venv/bin/python benchmarks/rl_step.py
(or pass --trl-python /tmp/trl-venv/bin/python to keep this interpreter for furlong)."""

# The shared workload; furlong's names, mapped to TRL's in ``trl_worker``.
PROMPTS, GROUP, MAX_TOKENS, TEMPERATURE, LR, GRAD_CLIP = 16, 8, 6, 1.0, 1e-3, 1.0
TASK, DIGITS, REWARD = "reverse", 3, "bench_spread"


def bench_spread(response: str, problem: Any) -> float:
    """A deterministic score that varies between samples. A random-weight model never gets an
    exact match, so with a real verifier every advantage would be zero, furlong would skip the
    update (no signal, no step) and TRL would still run it: the step would not be the same
    work. This keeps the forward/backward and the optimizer step in every step, on both sides."""
    return sum(map(ord, response)) % 7 / 6


def register_reward() -> None:
    from furlong.rl.tasks import REWARDS

    REWARDS[REWARD] = bench_spread


RESULT = "RESULT "  # prefix of a worker's one JSON line on stdout


# ------------------------------------------------------------------ workers (subprocesses)


def furlong_worker(model_dir: str, steps: int, out_dir: str) -> dict[str, Any]:
    from furlong.metrics import read_metrics
    from furlong.rl.config import load_config
    from furlong.rl.loop import train

    register_reward()

    overrides = [
        f"model.name={json.dumps(model_dir)}",
        f"task.name={TASK}",
        f"task.max_a={DIGITS}",  # reverse: the digit count
        f"task.reward={REWARD}",
        "task.eval_size=1",  # evaluation runs before step 1 and with the last step only
        "task.eval_samples=0",
        f"rollout.prompts_per_step={PROMPTS}",
        f"rollout.group_size={GROUP}",
        f"rollout.max_tokens={MAX_TOKENS}",
        f"rollout.temperature={TEMPERATURE}",
        "algo.advantage=grpo",
        "algo.objective=importance_sampling",
        "algo.normalize=token",
        "algo.scale_by_std=true",
        "algo.kl_coef=0.0",
        "run.log_kl=false",  # TRL with beta = 0 keeps no reference model either
        "algo.minibatches=1",
        f"algo.learning_rate={LR}",
        f"algo.grad_clip_norm={GRAD_CLIP}",
        f"run.steps={steps + 1}",  # the extra last step carries the final eval: dropped
        f"run.eval_every={steps + 10}",
        f"run.out_dir={json.dumps(out_dir)}",
        "run.export_hf=false",
        "run.progress=false",
    ]
    train(load_config(None, overrides))
    rows = [r for r in read_metrics(Path(out_dir) / "metrics.jsonl") if r["step"] >= 1]
    rows = [r for r in rows if "eval_greedy" not in r]
    assert len(rows) == steps, f"expected {steps} eval-free steps, got {len(rows)}"
    assert not any(r["actor_skipped:sum"] for r in rows), "a step skipped its update"
    return {
        "seconds": [r["step_seconds"] for r in rows],
        "completion_tokens": statistics.mean(r["response_tokens:mean"] for r in rows),
        "reward": statistics.mean(r["reward:mean"] for r in rows),
    }


def trl_worker(model_dir: str, steps: int, out_dir: str) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from furlong.rl.tasks import REWARDS, Problem, reverse

    train_split, _ = reverse(DIGITS)
    # Conversational prompts: TRL renders them with the tokenizer's chat template, as furlong.
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": p.prompt}], "answer": p.answer}
            for p in train_split
        ]
    )
    register_reward()
    verifier = REWARDS[REWARD]
    batches: list[tuple[int, float]] = []  # (completions, mean tokens) per reward call

    def reward(completions: list, answer: list[str], completion_ids: list, **_: Any) -> list[float]:
        batches.append((len(completions), statistics.mean(map(len, completion_ids))))
        return [
            verifier(c[0]["content"], Problem("", a))
            for c, a in zip(completions, answer, strict=True)
        ]

    ends: list[float] = []
    threads: list[int] = []

    class StepClock(TrainerCallback):
        # A step is the time between consecutive step ends: the batch fetch, generation,
        # scoring, forward/backward and optimizer step, and whatever the Trainer does between.
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter())

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter())
            threads.append(torch.get_num_threads())

    config = GRPOConfig(
        output_dir=out_dir,
        max_steps=steps,
        # One step = one generation of 128 completions + one optimizer step over all of them:
        # 128 completions per device batch, no accumulation, one step per generation.
        per_device_train_batch_size=PROMPTS * GROUP,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=GROUP,
        max_completion_length=MAX_TOKENS,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        # furlong's loss and optimizer: token-level normalization over the batch ("dapo"),
        # group-std scaled advantages, no KL (no reference model), AdamW as furlong's
        # AdamParams (beta2 0.95, eps 1e-12, no decay), constant lr, clip 1.0.
        loss_type="dapo",
        scale_rewards="group",
        beta=0.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-12,
        max_grad_norm=GRAD_CLIP,
        # fp32 on CPU without TRL's GPU-oriented defaults (bf16, gradient checkpointing).
        use_cpu=True,
        bf16=False,
        fp16=False,
        activation_checkpointing=False,  # TRL's gradient_checkpointing=True default
        use_vllm=False,
        # Nothing but training: no logging, saving, evaluation or progress bar.
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[StepClock()],
    )
    trainer.train()
    # The mapping above must give exactly one 128-completion generation per optimizer step.
    assert trainer.state.global_step == steps, trainer.state.global_step
    assert [n for n, _ in batches] == [PROMPTS * GROUP] * steps, [n for n, _ in batches]
    assert len(set(threads)) == 1, threads
    return {
        "seconds": [b - a for a, b in zip(ends, ends[1:], strict=False)],
        "completion_tokens": statistics.mean(t for _, t in batches),
        "threads_in_step": threads[0],
    }


def worker_main(side: str, model_dir: str, steps: int, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)  # before any work: same intra-op pool size on both sides
    import transformers

    with tempfile.TemporaryDirectory(prefix=f"rl_step_{side}_") as out:
        run = furlong_worker if side == "furlong" else trl_worker
        result = run(model_dir, steps, out)
    result.setdefault("threads_in_step", torch.get_num_threads())
    result |= {"torch": torch.__version__, "transformers": transformers.__version__}
    if side == "trl":
        import trl

        result["trl"] = trl.__version__
    print(RESULT + json.dumps(result), flush=True)


# ------------------------------------------------------------------ driver


def run_worker(
    python: str, side: str, model_dir: Path, steps: int, threads: int, max_tokens: int
) -> dict:
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": "ignore",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    cmd = [python, str(Path(__file__).resolve()), "--worker", side, "--model-dir", str(model_dir)]
    cmd += ["--worker-steps", str(steps), "--threads", str(threads)]
    cmd += ["--max-tokens", str(max_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{side} worker failed (exit {proc.returncode})")
    return json.loads(lines[-1].removeprefix(RESULT))


def trl_version(python: str) -> str | None:
    probe = subprocess.run(
        [python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True
    )
    return probe.stdout.strip() if probe.returncode == 0 else None


def write_model(spec: str, out: Path) -> Path:
    if Path(spec).is_dir():
        return Path(spec)
    from transformers.utils import logging

    from furlong.models.loading import save_hf_dir
    from furlong.models.presets import build_preset

    logging.disable_progress_bar()

    model, tokenizer = build_preset(spec, seed=0)  # as `furlong init-model --preset SPEC`
    return save_hf_dir(model, tokenizer, out)


def main() -> None:
    global MAX_TOKENS  # both workers read it; a longer generation shifts the step's balance
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small-qwen3", help="preset name or HF directory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per measurement")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per measurement")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads, both")
    parser.add_argument("--trl-python", default=sys.executable, help="interpreter with trl")
    parser.add_argument("--quick", action="store_true", help="1 round, 1 + 3 steps per side")
    parser.add_argument(
        "--max-tokens", type=int, default=MAX_TOKENS, help="new tokens per completion at most"
    )
    parser.add_argument("--worker", choices=("furlong", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--worker-steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    MAX_TOKENS = args.max_tokens
    if args.worker:
        worker_main(args.worker, args.model_dir, args.worker_steps, args.threads)
        return
    if args.quick:
        args.rounds, args.warmup, args.steps = 1, 1, 3
    version = trl_version(args.trl_python)
    if version is None:
        print(INSTALL_HINT.format(python=args.trl_python), file=sys.stderr)
        raise SystemExit(2)

    with tempfile.TemporaryDirectory(prefix="rl_step_") as tmp:
        model_dir = write_model(args.model, Path(tmp) / "model")
        print(
            f"{args.model}: {TASK} ({DIGITS} digits, {REWARD}), {PROMPTS} prompts x {GROUP} "
            f"samples, <= {MAX_TOKENS} new tokens, temperature {TEMPERATURE}, lr {LR}, no KL; "
            f"{args.threads} threads; {args.warmup} warm-up + {args.steps} timed steps per side "
            f"and round; TRL {version} ({args.trl_python})"
        )
        total = args.warmup + args.steps
        pythons = {"furlong": sys.executable, "trl": args.trl_python}
        ours_all: list[float] = []
        theirs_all: list[float] = []
        ratios: list[float] = []
        for i in range(args.rounds):
            order = ("furlong", "trl") if i % 2 == 0 else ("trl", "furlong")  # cancel drift
            results = {
                s: run_worker(pythons[s], s, model_dir, total, args.threads, args.max_tokens)
                for s in order
            }
            ours = results["furlong"]["seconds"][args.warmup :]
            theirs = results["trl"]["seconds"][args.warmup :]
            ours_all += ours
            theirs_all += theirs
            ratio = statistics.median(theirs) / statistics.median(ours)
            ratios.append(ratio)
            f, t = results["furlong"], results["trl"]
            print(
                f"round {i + 1}: furlong {statistics.median(ours):6.3f} s/step "
                f"({min(ours):.3f}-{max(ours):.3f}, {f['completion_tokens']:.2f} tok/completion)"
                f"   TRL {statistics.median(theirs):6.3f} s/step "
                f"({min(theirs):.3f}-{max(theirs):.3f}, {t['completion_tokens']:.2f} tok/"
                f"completion)   ratio {ratio:.2f}   [threads {f['threads_in_step']}/"
                f"{t['threads_in_step']}, transformers {f['transformers']}/{t['transformers']}]"
            )
    ratio = statistics.median(ratios)
    print(
        f"\nmedian step: furlong {statistics.median(ours_all):.3f} s, "
        f"TRL {statistics.median(theirs_all):.3f} s"
    )
    print(
        f"{'PASS' if ratio >= 1.5 else 'FAIL'}: median ratio (TRL s / furlong s) {ratio:.2f} "
        f"(per round: {', '.join(f'{r:.2f}' for r in ratios)}; target >= 1.5)"
    )


if __name__ == "__main__":
    main()
