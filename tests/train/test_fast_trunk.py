"""Training passes through FastForward equal the HF decoder's: log-probs, losses and gradients,
plain and shared-prefix, with the pad id inside real tokens (HF's embedding gives its row no
gradient); the fused RMSNorm backward equals autograd through HF's norm; a peft LoRA adapter
runs on the fast trunk with the HF decoder's results; models FastForward cannot run exactly
(checkpointing, LoRA dropout) keep the HF decoder."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from furlong.models import fast_forward
from furlong.models.fast_forward import FastForward

from .helpers import assert_close_dicts, engine, grads, grouped_datums

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("share_prefixes", [False, True], ids=["plain", "shared"])
@pytest.mark.parametrize("preset", ["tiny-qwen3", "small-llama"])
def test_fast_trunk_equals_the_hf_decoder(preset: str, share_prefixes: bool, monkeypatch) -> None:
    calls = []
    real = FastForward.hidden
    monkeypatch.setattr(FastForward, "hidden", lambda *a: calls.append(1) or real(*a))
    fast = engine(preset, share_prefixes=share_prefixes)
    hf = engine(preset, share_prefixes=share_prefixes, fast_forward=False)
    datums = grouped_datums(0, pad_id=fast.pad_token_id)
    a = hf.forward_backward(datums, "ppo")
    assert not calls
    b = fast.forward_backward(datums, "ppo")
    assert calls  # the fast trunk ran
    for x, y in zip(a.outputs, b.outputs, strict=True):
        torch.testing.assert_close(y["logprobs"], x["logprobs"], atol=1e-5, rtol=0)
        torch.testing.assert_close(y["loss"], x["loss"], atol=1e-5, rtol=1e-5)
    assert b.metrics["loss:sum"] == pytest.approx(a.metrics["loss:sum"], rel=1e-5)
    ga, gb = grads(hf), grads(fast)
    assert_close_dicts(ga, gb, rel=1e-4)
    embed = next(k for k in ga if "embed_tokens" in k)
    assert float(ga[embed][fast.pad_token_id].abs().max()) == 0.0  # padding_idx: no gradient
    assert float(gb[embed][fast.pad_token_id].abs().max()) == 0.0
    assert float(gb[embed].abs().sum()) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_backward_equals_autograd_through_hf(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    norm = Qwen3RMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=g) + 0.5)
    x = (torch.randn(5, 3, 48, generator=g) * 3 + 1).to(dtype).requires_grad_()
    up = torch.randn(5, 3, 48, generator=g).to(dtype)
    want = norm(x)
    want.backward(up)
    dx, dw = x.grad.clone(), norm.weight.grad.clone()
    x.grad = norm.weight.grad = None
    got = fast_forward._rms(x, norm)
    got.backward(up)
    assert got.dtype == want.dtype and x.grad.dtype == dtype and norm.weight.grad.dtype == dtype
    assert torch.equal(got, want)  # the forward is HF's, op for op
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(x.grad.float(), dx.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(norm.weight.grad.float(), dw.float(), atol=tol * 10, rtol=tol)


def _lora_engine(fast_forward: bool, dropout: float = 0.0, dtype: torch.dtype = torch.float32):
    """tiny-qwen3 with a rank-4 adapter on every linear, its B nonzero (peft starts it at 0);
    a bf16 base gets fp32 adapters (peft's default)."""
    from furlong.train import lora
    from furlong.train.engine import EngineConfig, TrainingEngine

    base = engine("tiny-qwen3")
    base.model.to(dtype)
    spec = lora.LoraSpec(rank=4, train_mlp=True, train_attn=True, train_unembed=True)
    config = lora.peft_config(base.model, spec)
    config.lora_dropout = dropout
    peft = lora.add_adapter(None, base.model, "actor", config, 0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return TrainingEngine(
        peft,
        config=EngineConfig(fast_forward=fast_forward),
        trainable=lora.adapter_params(peft, "actor"),
    )


# fp32: summation order only. A bf16 base with fp32 adapters: the adapters round like peft's
# (base + adapter in fp32, once to bf16 per layer), but a bf16 training pass runs attention in
# fp32 (fast_forward._attention_dtype) where HF runs it in bf16: 0.010 nats and 1.9% of the largest
# gradient measured
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (3e-2, 5e-2)}  # logprobs, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lora_adapter_runs_on_the_fast_trunk(dtype: torch.dtype, monkeypatch) -> None:
    calls = []
    real = FastForward.hidden
    monkeypatch.setattr(FastForward, "hidden", lambda *a: calls.append(1) or real(*a))
    datums = grouped_datums(3)
    hf = _lora_engine(fast_forward=False, dtype=dtype)
    a = hf.forward_backward(datums, "ppo")
    assert not calls
    fast = _lora_engine(fast_forward=True, dtype=dtype)
    assert {p.dtype for p in fast.params} == {torch.float32}  # adapters: fp32 in both cases
    b = fast.forward_backward(datums, "ppo")
    assert calls  # the fast trunk ran, through peft's LoRA layers
    lp_tol, grad_tol = TOLERANCE[dtype]
    for x, y in zip(a.outputs, b.outputs, strict=True):
        torch.testing.assert_close(y["logprobs"], x["logprobs"], atol=lp_tol, rtol=0)
    assert b.metrics["loss:sum"] == pytest.approx(a.metrics["loss:sum"], rel=lp_tol)
    ga, gb = grads(hf), grads(fast)
    assert all(float(g.abs().max()) > 0 for g in ga.values())  # every A and B is trained
    assert_close_dicts(ga, gb, rel=grad_tol)


def test_models_it_cannot_run_exactly_keep_the_hf_decoder(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(FastForward, "hidden", lambda *a: calls.append(1))
    datums = grouped_datums(0)
    engine("tiny-qwen3", gradient_checkpointing=True).forward_backward(datums, "ppo")
    dropped = _lora_engine(fast_forward=True, dropout=0.1)
    assert not FastForward.supports(dropped.model.get_base_model())
    out = dropped.forward_backward(datums, "ppo")
    assert not calls
    assert all(torch.isfinite(o["logprobs"]).all() for o in out.outputs)


def test_training_rows_padded_on_the_right_use_sdpa_causal_mask(monkeypatch) -> None:
    """Right padding (the trainer's collate): SDPA's is_causal, no mask tensor; left padding
    keeps the explicit mask. Either way the results equal the HF decoder's (test above)."""
    assert fast_forward._right_padded(torch.tensor([[1, 1, 0], [1, 1, 1]]))
    assert not fast_forward._right_padded(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    seen = []
    real = fast_forward.F.scaled_dot_product_attention
    monkeypatch.setattr(
        fast_forward.F,
        "scaled_dot_product_attention",
        lambda *a, **k: seen.append((a[3] is None, k.get("is_causal"))) or real(*a, **k),
    )
    engine("tiny-qwen3").forward_backward(grouped_datums(1), "ppo")
    assert seen and all(s == (True, True) for s in seen)
