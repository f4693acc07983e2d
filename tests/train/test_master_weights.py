"""bf16 models train fp32 master weights: gradients sum in fp32, the optimizer steps the masters,
the model holds them rounded to nearest, and checkpoints, Muon, sleep/wake and a second engine
on the same model all see the masters."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from furlong.train.engine import EngineConfig, TrainingEngine
from furlong.train.master_weights import MasterWeights
from furlong.train.optim import OptimizerConfig
from furlong.types import AdamParams
from tests.train.helpers import random_datums

BF16 = torch.bfloat16
ADAM = AdamParams(learning_rate=1e-3, weight_decay=0.0, grad_clip_norm=0.0)


def bf16_engine(**config: object) -> TrainingEngine:
    return TrainingEngine.from_pretrained("tiny-qwen3", EngineConfig(**config), seed=0, dtype=BF16)


def test_updates_below_bf16_spacing_accumulate_in_the_master() -> None:
    """Hand-derived: AdamW's first steps move a weight by lr * sign(grad) = 1e-3 each (m / sqrt(v)
    is exactly 1 for a constant gradient), below half of bf16's spacing at 1.0 (2^-7 / 2). Pure
    bf16 would round 1.0 - 1e-3 back to 1.0 forever; the fp32 master reaches 1 - 4e-3 after four
    steps, which rounds to 1 - 2^-8 = 0.99609375."""
    w = torch.nn.Parameter(torch.ones(3, dtype=BF16))
    masters = MasterWeights([w])
    opt = torch.optim.AdamW(masters.params, lr=1e-3, weight_decay=0.0)
    naive = torch.nn.Parameter(torch.ones(3, dtype=BF16))
    naive_opt = torch.optim.AdamW([naive], lr=1e-3, weight_decay=0.0)
    for step in range(1, 5):
        (w * 2.0).sum().backward()  # d/dw = 2 (bf16), handed to the master in fp32
        (naive * 2.0).sum().backward()
        assert w.grad is None and masters.params[0].grad.dtype == torch.float32
        opt.step(), naive_opt.step()
        opt.zero_grad(), naive_opt.zero_grad()
        masters.publish()
        torch.testing.assert_close(
            masters.params[0], torch.full((3,), 1 - step * 1e-3), rtol=0, atol=1e-6
        )
    assert torch.equal(naive, torch.ones(3, dtype=BF16))  # every step rounded away
    assert torch.equal(w, torch.full((3,), 0.99609375, dtype=BF16))


def test_gradients_of_several_calls_sum_in_fp32_and_step_like_adamw() -> None:
    """Independent: the same bf16 model run by plain autograd, each call's bf16 gradient summed
    in fp32, then torch's AdamW on fp32 copies of the weights."""
    e = bf16_engine()
    ref = copy.deepcopy(e.model)  # deep copies are new parameters: no master, no hook
    calls = [random_datums([7, 5], seed=s) for s in (1, 2)]
    summed: dict[str, torch.Tensor] = {}
    for datums in calls:
        e.forward_backward(datums, "cross_entropy")
        ref.zero_grad()
        loss = torch.zeros(())
        for d in datums:
            logits = ref(input_ids=d.model_input.view(1, -1)).logits[0].float()
            targets = d.loss_fn_inputs["target_tokens"][:, None]
            lp = torch.log_softmax(logits, -1).gather(-1, targets).squeeze(-1)
            loss = loss - (lp * d.loss_fn_inputs["weights"]).sum()
        loss.backward()
        for n, p in ref.named_parameters():
            summed[n] = summed.get(n, 0) + p.grad.float()
    assert all(p.grad is None for p in e.masters.model_params)  # all of it went to the masters
    for name, master in zip(e.param_names, e.params, strict=True):
        assert master.dtype == torch.float32
        scale = float(summed[name].abs().max()) or 1.0
        # bf16 gradients: the fused head and the HF head round differently (~2^-8 relative)
        assert float((master.grad - summed[name]).abs().max()) <= 0.02 * scale, name
    assert any(float(m.grad.abs().max()) > 0 for m in e.params)

    expected = [m.detach().clone().requires_grad_() for m in e.params]
    for x, m in zip(expected, e.params, strict=True):
        x.grad = m.grad.clone()
    betas, eps = (ADAM.beta1, ADAM.beta2), ADAM.eps
    torch.optim.AdamW(expected, lr=1e-3, betas=betas, eps=eps, weight_decay=0.0).step()
    e.optim_step(ADAM)
    for x, m, p in zip(expected, e.params, e.masters.model_params, strict=True):
        assert torch.equal(m.detach(), x.detach())
        assert p.dtype == BF16 and torch.equal(p.detach(), x.detach().to(BF16))


def test_checkpoint_holds_the_masters_and_continues_bit_identically(tmp_path: Path) -> None:
    a = bf16_engine()
    for s in range(2):
        a.forward_backward(random_datums([6, 4], seed=s), "cross_entropy")
        a.optim_step(ADAM)
    a.save_state(tmp_path / "ckpt")
    b = bf16_engine()
    b.load_state(tmp_path / "ckpt")
    for x, y in zip(a.params, b.params, strict=True):
        assert x.dtype == torch.float32 and torch.equal(x, y)  # fp32 as trained, not rounded
    assert any(not torch.equal(m, m.to(BF16).float()) for m in b.params)  # below bf16 spacing
    for e in (a, b):
        e.forward_backward(random_datums([6, 4], seed=9), "cross_entropy")
        e.optim_step(ADAM)
    for x, y in zip(a.params, b.params, strict=True):
        assert torch.equal(x, y)
    for x, y in zip(a.masters.model_params, b.masters.model_params, strict=True):
        assert torch.equal(x, y)


def test_muon_keeps_embeddings_and_head_with_adamw_by_their_model_parameter() -> None:
    e = bf16_engine(optimizer=OptimizerConfig(kind="muon"))
    embed = e.model.get_input_embeddings().weight
    master_of = dict(zip(map(id, e.masters.model_params), e.params, strict=True))
    muon = next(p for p in e.optimizer.param_groups if p.get("kind") != "adamw")["params"]
    assert muon and all(p.dtype == torch.float32 for p in muon)
    assert all(p is not master_of[id(embed)] for p in muon)
    e.forward_backward(random_datums([6, 4]), "cross_entropy")
    before = [p.detach().clone() for p in e.masters.model_params]
    e.optim_step(AdamParams(learning_rate=1e-2))
    moved = [not torch.equal(b, p) for b, p in zip(before, e.masters.model_params, strict=True)]
    assert sum(moved) >= len(moved) - 2  # norms whose step rounds away may stay


def test_sleep_and_wake_restore_masters_and_model_exactly() -> None:
    e = bf16_engine()
    e.forward_backward(random_datums([6, 4]), "cross_entropy")
    e.optim_step(ADAM)
    masters = [m.detach().clone() for m in e.params]
    model = [p.detach().clone() for p in e.masters.model_params]
    e.sleep()
    assert all(p.numel() == 0 for p in e.masters.model_params)
    assert all(w.dtype == torch.float32 for w in e.host_weights.values())
    e.wake()
    assert all(torch.equal(a, b) for a, b in zip(masters, e.params, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(model, e.masters.model_params, strict=True))


def test_a_second_engine_continues_the_master_unless_the_weights_changed() -> None:
    """The RL actor after the warm-up's engine: same model, the warm-up's fp32 progress kept."""
    first = bf16_engine()
    first.forward_backward(random_datums([6, 4]), "cross_entropy")
    first.optim_step(ADAM)
    second = TrainingEngine(first.model, first.tokenizer)
    assert all(a is b for a, b in zip(first.params, second.params, strict=True))
    with torch.no_grad():  # someone else writes the weights (a checkpoint load outside the engine)
        first.masters.model_params[0].add_(1.0)
    third = TrainingEngine(first.model, first.tokenizer)
    assert third.params[0] is not first.params[0]
    assert torch.equal(third.params[0], first.masters.model_params[0].float())
    third.forward_backward(random_datums([6, 4]), "cross_entropy")
    assert third.params[0].grad is not None and first.params[0].grad is None


def test_weights_for_the_rollout_are_in_the_model_precision() -> None:
    e = bf16_engine()
    assert {w.dtype for w in e.weights().values()} == {BF16}
