"""Optimizers: Muon (torch.optim.Muon's update, per matrix, FP32 Newton–Schulz option) for
hidden matrices + AdamW for the rest; selection, validation and checkpoint continuation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from furlong.errors import InputError
from furlong.models import build_preset
from furlong.train.engine import EngineConfig, TrainingEngine
from furlong.train.muon import DEFAULT_NS_COEFFICIENTS, Muon, newton_schulz
from furlong.train.optim import OptimizerConfig, build_optimizer
from furlong.types import AdamParams
from tests.train.helpers import params, random_datums

pytestmark = pytest.mark.usefixtures("one_thread")
ADAM = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1)


def matrices(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def run(optimizer: torch.optim.Optimizer, ps: list[torch.Tensor], steps: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()


def engine(preset: str, **optimizer: object) -> TrainingEngine:
    config = EngineConfig(optimizer=OptimizerConfig(**optimizer))  # type: ignore[arg-type]
    return TrainingEngine.from_pretrained(preset, config, seed=0)


def train(e: TrainingEngine, steps: int, seed: int = 0) -> None:
    for i in range(steps):
        e.forward_backward(random_datums([6, 4], seed=seed + i), "cross_entropy")
        e.optim_step(ADAM)


# ---------------------------------------------------------------- Muon math


def test_bf16_muon_is_torch_muon_on_matrices() -> None:
    ours, ref = matrices((16, 24), (32, 8), (12, 12)), matrices((16, 24), (32, 8), (12, 12))
    kw = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    opt, ref_opt = Muon(ours, ns_dtype="bfloat16", **kw), torch.optim.Muon(ref, **kw)
    run(opt, ours)
    run(ref_opt, ref)
    for p, q in zip(ours, ref, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"])


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48), (8, 128)])
def test_fp32_newton_schulz_matches_torch_bf16_to_bf16_rounding(shape) -> None:
    """Same math, fp32 instead of bf16: relative Frobenius difference <= 3e-2 (measured
    1.0-1.8e-2 on these shapes; bf16 keeps 8 mantissa bits over 5 iterations), and fp32 is
    within 1e-5 of the same iteration in float64."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    fp32 = newton_schulz(g, dtype=torch.float32)
    bf16 = newton_schulz(g, dtype=torch.bfloat16).float()
    fp64 = newton_schulz(g.double(), dtype=torch.float64).float()
    assert float((fp32 - bf16).norm() / bf16.norm()) <= 3e-2
    assert float((fp32 - fp64).norm() / fp64.norm()) <= 1e-5


def reference_newton_schulz(g: np.ndarray, steps: int = 5) -> np.ndarray:
    """Independent float64 NumPy: X <- aX + (bA + cA²)X with A = XXᵀ on the wide orientation."""
    a, b, c = DEFAULT_NS_COEFFICIENTS
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / max(np.linalg.norm(x), 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def test_muon_step_by_hand() -> None:
    w0 = np.array([[0.5, -1.0, 0.25], [2.0, 0.0, -0.5], [0.1, 0.3, 0.7], [-1.2, 0.4, 0.0]])
    g1 = np.array([[1.0, 0.5, -0.2], [0.0, -1.5, 0.3], [0.7, 0.1, 0.9], [-0.4, 0.8, 0.2]])
    g2 = np.array([[-0.3, 0.2, 0.6], [1.1, 0.0, -0.7], [0.2, -0.9, 0.4], [0.5, 0.3, -0.1]])
    lr, wd, mu = 0.05, 0.1, 0.95
    (p,) = [torch.nn.Parameter(torch.tensor(w0, dtype=torch.float32))]
    opt = Muon([p], lr=lr, weight_decay=wd, momentum=mu, ns_dtype="float32")
    w, buf = w0.copy(), np.zeros_like(w0)
    for g in (g1, g2):
        p.grad = torch.tensor(g, dtype=torch.float32)
        opt.step()
        buf = mu * buf + (1 - mu) * g  # torch's buffer is an EMA (lerp)
        nesterov = (1 - mu) * g + mu * buf
        w = w * (1 - lr * wd) - lr * math.sqrt(4 / 3) * reference_newton_schulz(nesterov)
    np.testing.assert_allclose(p.detach().numpy(), w, rtol=0, atol=2e-6)
    np.testing.assert_allclose(opt.state[p]["momentum_buffer"].numpy(), buf, atol=1e-7)


def test_3d_experts_are_muon_per_matrix() -> None:
    (stacked,) = matrices((4, 12, 6))
    singles = [torch.nn.Parameter(m.clone()) for m in stacked.detach()]
    a = Muon([stacked], lr=0.02, ns_dtype="float32", adjust_lr_fn="original")
    b = Muon(singles, lr=0.02, ns_dtype="float32", adjust_lr_fn="original")
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        stacked.grad = torch.randn(stacked.shape, generator=g)
        for e, p in enumerate(singles):
            p.grad = stacked.grad[e].clone()
        a.step()
        b.step()
    for e, p in enumerate(singles):
        assert torch.equal(stacked[e], p)  # incl. the lr adjustment by each [12, 6] matrix
    assert a.state[stacked]["momentum_buffer"].shape == (4, 12, 6)


def test_muon_refuses_vectors() -> None:
    with pytest.raises(ValueError, match="2-D or 3-D"):
        Muon(matrices((5,)))


# ---------------------------------------------------------------- assignment and selection


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_embeddings_head_norms_go_to_adamw_matrices_and_experts_to_muon(preset) -> None:
    model, _ = build_preset(preset, seed=0)
    named = list(model.named_parameters())
    opt = build_optimizer(model, [p for _, p in named], OptimizerConfig(kind="muon"))
    adamw, muon = opt.parts
    in_muon = {id(p) for p in muon.param_groups[0]["params"]}
    to_muon = {n for n, p in named if id(p) in in_muon}
    to_adamw = {n for n, p in named if id(p) not in in_muon}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= to_adamw
    assert all(dict(named)[n].ndim == 1 or "embed" in n or "lm_head" in n for n in to_adamw)
    assert "model.layers.0.self_attn.q_proj.weight" in to_muon
    if preset == "tiny-qwen3-moe":
        assert "model.layers.0.mlp.experts.gate_up_proj" in to_muon  # [E, 2I, H]
        assert "model.layers.0.mlp.experts.down_proj" in to_muon
    assert muon.param_groups[0]["ns_dtype"] == "float32"  # auto on CPU
    assert len(to_muon) + len(to_adamw) == len(named)


def test_adam_params_drive_muon_lr_and_weight_decay_only() -> None:
    e = engine("tiny-qwen3", kind="muon")
    train(e, 1)
    adamw, muon = e.optimizer.parts
    group = muon.param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (ADAM.learning_rate, ADAM.weight_decay)
    assert (group["eps"], group["momentum"], group["nesterov"]) == (1e-7, 0.95, True)
    assert adamw.param_groups[0]["betas"] == (ADAM.beta1, ADAM.beta2)
    assert adamw.param_groups[0]["eps"] == ADAM.eps


def test_muon_engine_trains() -> None:
    e = engine("tiny-qwen3-moe", kind="muon")
    data = random_datums([8, 8], seed=5)
    losses = []
    for _ in range(4):
        losses.append(e.forward_backward(data, "cross_entropy").metrics["loss:sum"])
        e.optim_step(AdamParams(learning_rate=1e-2))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("kind", "sgd", "optimizer.kind: 'sgd' is not one of 'adamw', 'muon'"),
        ("state_store", "nvme", "optimizer.state_store"),
        ("chunk_bytes", 0, "optimizer.chunk_bytes: must be an integer > 0"),
        ("muon_momentum", 1.0, "optimizer.muon_momentum"),
        ("muon_ns_steps", 0, "optimizer.muon_ns_steps"),
        ("muon_ns_dtype", "fp8", "optimizer.muon_ns_dtype"),
        ("muon_adjust_lr", "none", "optimizer.muon_adjust_lr"),
    ],
)
def test_config_validation(field: str, value: object, message: str) -> None:
    with pytest.raises(InputError, match=message.replace("[", r"\[")):
        OptimizerConfig(**{field: value})  # type: ignore[arg-type]


def test_disk_store_needs_a_directory() -> None:
    with pytest.raises(InputError, match="optimizer.disk_dir: required"):
        OptimizerConfig(state_store="disk")


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_muon_checkpoint_continues_bit_identically(preset, tmp_path) -> None:
    a = engine(preset, kind="muon")
    train(a, 2)
    a.save_state(tmp_path / "ckpt")
    train(a, 2, seed=10)
    b = engine(preset, kind="muon")
    b.load_state(tmp_path / "ckpt")
    assert b.step == 2
    train(b, 2, seed=10)
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


def test_checkpoint_of_another_optimizer_is_refused_before_any_change(tmp_path) -> None:
    a = engine("tiny-qwen3")  # adamw
    train(a, 1)
    a.save_state(tmp_path / "adamw")
    b = engine("tiny-qwen3", kind="muon")
    before = params(b)
    with pytest.raises(InputError, match="holds adamw optimizer state, this engine uses muon"):
        b.load_state(tmp_path / "adamw")
    assert all(torch.equal(before[n], p) for n, p in params(b).items())
    b.load_state(tmp_path / "adamw", optimizer=False)  # the weights alone are fine
    assert all(torch.equal(params(a)[n], p) for n, p in params(b).items())
