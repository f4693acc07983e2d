"""Short end-to-end RL runs on the tiny model, checked for their mechanism: GRPO, and PPO with a
critic, take their optimizer steps, publish every step's weights to the rollout engine (which
samples the next step from them) and write metrics JSONL, a plot and an HF policy that
transformers loads; Muon with disk state under colocation, a bf16 policy on fp32 masters, MoE
replay, and a step without signal that moves nothing.

A few steps of a tiny model say nothing about learning (their reward trend is a lottery of the
CPU's rounding): that claim is the robustness tier's (tests/rl/test_demo_robustness.py)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from furlong.rl import tasks
from furlong.rl.build import Parts, build_parts
from furlong.rl.config import load_config
from furlong.rl.loop import RunSummary, train
from furlong.train.filemap import is_file_backed
from furlong.train.muon import Muon

pytestmark = pytest.mark.usefixtures("one_thread")
BF16 = torch.bfloat16


@dataclass
class Run:
    summary: RunSummary
    rows: list[dict[str, float]]
    parts: Parts  # built here and handed to train(), to be inspected afterwards
    actor_start: dict[str, torch.Tensor]  # the actor's weights before its first step
    critic_start: dict[str, torch.Tensor] | None


def run(tmp_path: Path, *overrides: str) -> Run:
    config = load_config(
        None,
        [
            "model.name=tiny-qwen3",
            "task.reward=short_text",
            "task.eval_size=8",
            "task.eval_samples=2",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.max_tokens=6",
            "algo.learning_rate=1e-2",
            "run.steps=16",
            "run.eval_every=8",
            "run.progress=false",
            f"run.out_dir={tmp_path}",
            *overrides,
        ],
    )
    parts = build_parts(config, config.scale, None)
    actor = {n: w.detach().clone() for n, w in parts.actor.weights().items()}
    critic = None if parts.critic is None else params(parts.critic.model)
    summary = train(config, parts=parts)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return Run(summary, rows, parts, actor, critic)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def moved(now: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per weight, the largest change of an element."""
    assert now.keys() == start.keys()
    return {n: float((now[n].float() - start[n].float()).abs().max()) for n in start}


def assert_trained_and_published(r: Run, minibatches: int = 1) -> None:
    """Each minibatch with a learning signal took one optimizer step with a finite, nonzero
    gradient norm; every weight moved by more than rounding; each step's weights reached the
    rollout engine, whose samples the trainer then scores as the rollout did (on-policy)."""
    steps = [row for row in r.rows if row["step"] > 0]
    assert all(math.isfinite(v) for row in r.rows for v in row.values()), r.rows
    ran = [row for row in steps if "actor_skipped:sum" in row]  # the steps the actor ran
    trained = [row for row in ran if row["actor_skipped:sum"] < minibatches]
    assert ran and len(trained) >= len(ran) // 2, ran  # the reward gives a signal
    assert r.parts.actor.step == sum(minibatches - row["actor_skipped:sum"] for row in ran)
    for row in trained:
        assert row["grad_norm:mean"] > 0 and row["logprob_diff:mean"] < 1e-4, row
    now = r.parts.actor.weights()
    change = moved(now, r.actor_start)
    assert min(change.values()) > 1e-3, change  # lr 1e-2: ~1e-2 a step, rounding ~1e-7
    rollout = r.parts.rollout
    assert rollout.weight_version == len(steps)  # one publication a step
    if "weights" in rollout.offloaded:  # a colocated export woke the trainer for good
        rollout.onload(["weights"])
    served = dict(rollout.model.named_parameters())
    for n, w in now.items():
        assert torch.equal(served[n], w.to(served[n].dtype)), n


def test_grpo_trains_publishes_and_writes_its_outputs(tmp_path, short_reward) -> None:
    r = run(tmp_path)
    assert_trained_and_published(r)
    rows, summary = r.rows, r.summary
    assert rows[0]["step"] == 0 and "eval_greedy" in rows[0] and "eval_pass1" in rows[0]
    assert (
        summary.before.keys()
        == summary.after.keys()
        == {"eval_greedy", "eval_solved", "eval_stopped", "eval_pass1"}
    )
    assert (rows[0]["eval_greedy"], rows[-1]["eval_greedy"]) == (
        summary.before["eval_greedy"],
        summary.after["eval_greedy"],
    )
    for key in ("entropy:mean", "grad_norm:mean", "rollout_tokens_per_s", "step_seconds"):
        assert key in rows[1]
    assert (tmp_path / "curves.png").stat().st_size > 1000
    policy = AutoModelForCausalLM.from_pretrained(summary.hf_dir)
    assert policy(torch.tensor([[1, 2, 3]])).logits.shape[-1] == 768
    exported = dict(policy.named_parameters())
    assert all(torch.equal(exported[n], w) for n, w in r.parts.actor.weights().items())


def test_ppo_with_a_critic_trains_both_and_hands_off(tmp_path, short_reward) -> None:
    """Step 1 trains the critic alone (its warm-up); every step takes one critic step per
    minibatch (two), and from step 2 one actor step per minibatch with a signal."""
    r = run(
        tmp_path,
        "algo.advantage=gae",
        "algo.objective=ppo",
        "algo.minibatches=2",
        "critic.warmup_steps=1",
        "colocate.enabled=true",
        "run.export_hf=false",
    )
    assert_trained_and_published(r, minibatches=2)
    rows = r.rows
    assert "value_loss:sum" in rows[1] and "grad_norm:mean" not in rows[1]  # critic-only step
    assert "actor_skipped:sum" not in rows[1] and "grad_norm:mean" in rows[2]
    assert all("value_loss:sum" in row for row in rows[1:])
    critic = r.parts.critic
    assert critic is not None and critic.step == 2 * 16
    assert r.critic_start is not None
    change = moved(params(critic.model), r.critic_start)
    assert min(change.values()) > 1e-3, change
    assert rows[2]["host_peak_bytes:max"] > 0  # the colocated hand-off ran
    assert r.summary.hf_dir is None


def test_moe_with_top_p_and_kl_replays_masks_and_routes(tmp_path, short_reward) -> None:
    """Sampling-mask replay (top-p < 1) and routing replay (MoE) keep the trainer on the
    rollout's distribution: its log-probs of the sampled tokens match the rollout's, and the
    KL to the frozen start is zero at step 1 (same weights, same kept sets) and grows."""
    r = run(
        tmp_path,
        "model.name=tiny-qwen3-moe",
        "rollout.top_p=0.8",
        "algo.kl_coef=0.05",
        "run.steps=6",
        "run.eval_every=6",
        "run.export_hf=false",
    )
    steps = [row for row in r.rows if row["step"] > 0]
    assert all(row["logprob_diff:mean"] < 1e-4 for row in steps)
    assert abs(steps[0]["kl:mean"]) < 1e-5
    assert steps[-1]["kl:mean"] > 1e-3


def test_a_batch_without_signal_takes_no_step(tmp_path, monkeypatch) -> None:
    """All rewards equal: every advantage is zero, and the policy must not move (a zero
    gradient would still move Adam's parameters through its momentum after earlier steps)."""
    from furlong.models import build_preset

    monkeypatch.setitem(tasks.REWARDS, "constant", lambda response, problem: 1.0)
    r = run(tmp_path, "task.reward=constant", "run.steps=3", "run.eval_every=3")
    assert [row["actor_skipped:sum"] for row in r.rows[1:]] == [1.0, 1.0, 1.0]
    assert all("grad_norm:mean" not in row for row in r.rows[1:])
    assert r.parts.actor.step == 0 and r.parts.rollout.weight_version == 3  # still published
    start, _ = build_preset("tiny-qwen3", seed=0)
    final = AutoModelForCausalLM.from_pretrained(r.summary.hf_dir)
    for name, p in start.state_dict().items():
        assert torch.equal(final.state_dict()[name], p), name


def test_muon_with_disk_state_and_colocation(tmp_path, short_reward) -> None:
    """The [optimizer] group reaches the actor: Muon steps its hidden matrices (AdamW the rest),
    every state tensor lives in a file-backed mapping under optimizer.disk_dir, and the
    colocated hand-off leaves that state where it is: the trainer's host backup holds its
    weights and nothing of the state but AdamW's scalar step counts."""
    state = tmp_path / "state"
    state.mkdir()
    r = run(
        tmp_path / "run",
        "optimizer.kind=muon",
        "optimizer.state_store=disk",
        f'optimizer.disk_dir="{state}"',
        "colocate.enabled=true",
        "run.steps=8",
        "run.eval_every=8",
        "run.export_hf=false",
    )
    assert_trained_and_published(r)
    actor, colocation = r.parts.actor, r.parts.colocation
    assert colocation is not None and r.rows[-1]["host_peak_bytes:max"] > 0
    weights = actor.weights()  # asleep since the last publication: its host backup
    backup = colocation.ledger.regions["backup"]
    colocation.finish()  # awake, as an export would find it
    optimizer = actor.optimizer
    assert (optimizer.kind, optimizer.store.kind) == ("muon", "disk")
    adamw, muon = optimizer.parts
    assert type(adamw) is torch.optim.AdamW and type(muon) is Muon
    hidden = muon.param_groups[0]["params"]
    assert len(hidden) >= 7 and all(p.ndim == 2 for p in hidden)  # q k v o gate up down
    assert all(float(muon.state[p]["momentum_buffer"].abs().max()) > 0 for p in hidden)
    tensors = [
        v
        for part in optimizer.parts
        for s in part.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    ]
    mapped = [v for v in tensors if v.dim() > 0]
    assert len(mapped) == len(hidden) + 2 * len(adamw.state)  # momentum; exp_avg, exp_avg_sq
    assert all(is_file_backed(v) for v in mapped)
    assert optimizer.store.file_backed_bytes(optimizer.parts) == sum(v.nbytes for v in mapped)
    steps = sum(v.nbytes for v in tensors if v.dim() == 0)  # AdamW's step counts
    assert backup == sum(w.nbytes for w in weights.values()) + steps  # no mapped byte moved
    assert (state / "optimizer_state").is_dir()  # the per-process directory was made there


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_bf16_policy_trains_fp32_masters(tmp_path, short_reward, algo: str) -> None:
    """model.dtype=bfloat16: the policy, the rollout's copy, the reference and the critic in
    bf16; every optimizer steps fp32 masters, from which the bf16 weights are rounded; PPO's
    critic and the colocated hand-off too."""
    ppo = ["algo.advantage=gae", "algo.objective=ppo", "critic.warmup_steps=1"]
    extra = [*ppo, "colocate.enabled=true", "run.log_kl=true"] if algo == "ppo" else []
    r = run(tmp_path, "model.dtype=bfloat16", *extra)
    assert_trained_and_published(r)
    parts = r.parts
    assert {p.dtype for p in parts.rollout.model.parameters()} == {BF16}
    trainers = [parts.actor] if parts.critic is None else [parts.actor, parts.critic]
    for e in trainers:
        assert e.masters.pairs and all(m.dtype == torch.float32 for m, _ in e.masters.pairs)
        assert all(p.dtype == BF16 for _, p in e.masters.pairs)
        assert all(torch.equal(m.to(BF16), p) for m, p in e.masters.pairs)  # rounded from them
        assert any(not torch.equal(m, m.to(BF16).float()) for m, _ in e.masters.pairs)
    if algo == "ppo":
        assert parts.reference is not None  # run.log_kl: frozen at the start, in bf16
        frozen = dict(parts.reference.model.named_parameters())
        assert all(torch.equal(frozen[n], w.to(BF16)) for n, w in r.actor_start.items())
        assert all(frozen[n].dtype == BF16 for n in r.actor_start)
        assert all("kl:mean" in row for row in r.rows[1:])
    policy = AutoModelForCausalLM.from_pretrained(r.summary.hf_dir)
    assert policy.dtype == BF16  # the export keeps the model's precision
    exported = dict(policy.named_parameters())
    assert all(torch.equal(exported[n], w) for n, w in parts.actor.weights().items())


def test_rollout_correction_scores_every_step_with_the_trainer(tmp_path, short_reward) -> None:
    """algo.tis_cap: the trainer's own log-probs of each step's tokens are taken before the
    actor trains; with the embedded engine in fp32 they are the rollout's (weights ~1, nothing
    truncated), and the run still trains and publishes."""
    r = run(tmp_path, "algo.tis_cap=2.0", "run.steps=3", "run.eval_every=3")
    steps = [row for row in r.rows if row.get("step", 0) > 0]
    assert len(steps) == 3
    for row in steps:
        assert row["tis_logprob_gap:max"] < 1e-4
        assert abs(row["tis_weight:mean"] - 1.0) < 1e-4 and row["tis_truncated:frac"] == 0.0
    assert_trained_and_published(r)
