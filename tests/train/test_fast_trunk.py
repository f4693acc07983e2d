"""Training passes through FastForward equal the HF decoder's: log-probs, losses and gradients,
plain and shared-prefix, with the pad id inside real tokens (HF's embedding gives its row no
gradient); the fused RMSNorm backward equals autograd through HF's norm; models FastForward
cannot run exactly (LoRA, checkpointing) keep the HF decoder."""

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


def test_models_it_cannot_run_exactly_keep_the_hf_decoder(monkeypatch) -> None:
    from furlong.train import lora
    from furlong.train.engine import TrainingEngine

    calls = []
    monkeypatch.setattr(FastForward, "hidden", lambda *a: calls.append(1))
    datums = grouped_datums(0)
    engine("tiny-qwen3", gradient_checkpointing=True).forward_backward(datums, "ppo")
    base = engine("tiny-qwen3")
    spec = lora.LoraSpec(rank=4, train_mlp=True, train_attn=True, train_unembed=False)
    peft = lora.add_adapter(None, base.model, "actor", lora.peft_config(base.model, spec), 0)
    assert not FastForward.supports(peft)
    adapter = TrainingEngine(peft, trainable=lora.adapter_params(peft, "actor"))
    out = adapter.forward_backward(datums, "ppo")
    assert not calls
    assert all(torch.isfinite(o["logprobs"]).all() for o in out.outputs)
