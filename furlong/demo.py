"""The CPU demo: supervised fine-tuning of a tiny offline model through the TrainingEngine.

The task is single-digit addition in chat form ("What is 3 + 4?" -> "7"). Only the answer
tokens carry weight, and the client pre-scales the weights by 1 / (answer tokens in the
batch): the engine itself never normalizes. A later issue replaces this with the RL demo.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from furlong.metrics import MetricsLog, plot_metrics
from furlong.train.engine import TrainingEngine
from furlong.types import AdamParams, Datum


@dataclass(frozen=True)
class DemoConfig:
    model: str = "small-qwen3"
    steps: int = 300
    batch_size: int = 32
    learning_rate: float = 3e-3
    seed: int = 0
    out_dir: str = "runs/demo"


def addition_example(tokenizer, a: int, b: int) -> Datum:
    """A chat datum whose weights are 1 on the assistant's answer tokens only."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"What is {a} + {b}?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt_ids = tokenizer(prompt)["input_ids"]
    answer_ids = tokenizer(f"{a + b}<|im_end|>")["input_ids"]
    tokens = prompt_ids + answer_ids
    weights = [0.0] * (len(prompt_ids) - 1) + [1.0] * len(answer_ids)
    return Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights})


def scaled(batch: list[Datum]) -> list[Datum]:
    """Client-side normalization: weights / (supervised tokens in the batch)."""
    total = sum(float(d.loss_fn_inputs["weights"].sum()) for d in batch)
    return [
        Datum(
            d.model_input, dict(d.loss_fn_inputs) | {"weights": d.loss_fn_inputs["weights"] / total}
        )
        for d in batch
    ]


@torch.no_grad()
def exact_match(engine: TrainingEngine, data: list[Datum]) -> float:
    """Share of examples whose every answer token is the model's argmax (teacher-forced)."""
    hits = 0
    for d in data:
        logits = engine.model(d.model_input.unsqueeze(0)).logits[0]
        w = d.loss_fn_inputs["weights"] > 0
        hits += bool((logits.argmax(-1)[w] == d.loss_fn_inputs["target_tokens"][w]).all())
    return hits / len(data)


def run_demo(cfg: DemoConfig) -> dict[str, float]:
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    engine = TrainingEngine.from_pretrained(cfg.model, seed=cfg.seed)
    data = [addition_example(engine.tokenizer, a, b) for a in range(10) for b in range(10)]
    out = Path(cfg.out_dir)
    log = MetricsLog(out / "metrics.jsonl")
    adam = AdamParams(learning_rate=cfg.learning_rate, beta2=0.99, eps=1e-8, grad_clip_norm=1.0)
    print(
        f"model {cfg.model}: {sum(p.numel() for p in engine.params):,} parameters, "
        f"{len(data)} addition facts, {cfg.steps} steps of {cfg.batch_size}"
    )
    first = last = None
    bar = tqdm(range(1, cfg.steps + 1), desc="train", unit="step")
    for step in bar:
        batch = scaled(rng.sample(data, cfg.batch_size))
        result = engine.forward_backward(batch, "cross_entropy")
        optim = engine.optim_step(adam)
        loss = result.metrics["loss:sum"]  # per answer token: the weights were pre-scaled
        first = loss if first is None else first
        last = loss
        log.write(step, {"loss": loss, "grad_norm": optim["grad_norm:mean"]})
        bar.set_postfix(loss=f"{loss:.3f}")
        if step == 1 or step % max(1, cfg.steps // 8) == 0:
            tqdm.write(f"step {step:4d}  loss/answer-token {loss:.4f}")
    eval_loss = engine.forward(scaled(data), "cross_entropy").metrics["loss:sum"]
    accuracy = exact_match(engine, data)
    plot_metrics(
        out / "metrics.jsonl",
        out / "loss.png",
        ["loss", "grad_norm"],
        title=f"furlong demo: {cfg.model} SFT on addition",
    )
    print(
        f"loss/answer-token {first:.3f} -> {last:.3f}; eval loss {eval_loss:.3f}; "
        f"exact match {accuracy:.0%}"
    )
    print(f"metrics: {out / 'metrics.jsonl'}  plot: {out / 'loss.png'}")
    return {"first_loss": first, "last_loss": last, "eval_loss": eval_loss, "accuracy": accuracy}
