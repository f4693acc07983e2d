"""A peft LoRA layer as the LM head takes the fused chunked path (``_LinearHeadLogprobs`` with
the adapter's low-rank term): log-probs and the gradients of the hidden states, A, B (and the
base weight when it trains) equal an independent full-logits computation; heads the fused path
cannot reproduce (two active adapters, dropout) take the generic path, also correct."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from furlong.train import logprobs as L
from furlong.train.logprobs import head_logprobs

H, V, R = 8, 23, 11


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(H, V, bias=True)


def _lora_head(seed: int, adapters: tuple[str, ...] = ("a",), dropout: float = 0.0) -> nn.Module:
    """A peft ``lora.Linear`` over a random linear, every adapter's A and B random (peft's B
    starts at zero, which would hide the adapter's gradient path)."""
    g = torch.Generator().manual_seed(seed)
    holder = _Head()
    for name in adapters:
        config = LoraConfig(r=3, lora_alpha=6, lora_dropout=dropout, target_modules=["lm_head"])
        with warnings.catch_warnings():  # a second adapter is what this test wants
            warnings.filterwarnings("ignore", "Already found a `peft_config`")
            holder = inject_adapter_in_model(config, holder, adapter_name=name)
    head = holder.lm_head
    head.set_adapter(list(adapters))
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    head.base_layer.weight.requires_grad_(False)
    head.base_layer.bias.requires_grad_(False)
    return head


def _independent(head: nn.Module, hidden: torch.Tensor, targets, temperature, coeffs):
    """Full logits written out from the parameters' values; autograd for every gradient."""
    h = hidden.clone().requires_grad_(True)
    w = head.base_layer.weight.detach().clone().requires_grad_(True)
    logits = h @ w.T + head.base_layer.bias.detach()
    leaves = {"hidden": h, "weight": w}
    for name in head.active_adapters:
        a = head.lora_A[name].weight.detach().clone().requires_grad_(True)
        b = head.lora_B[name].weight.detach().clone().requires_grad_(True)
        logits = logits + (h @ a.T @ b.T) * head.scaling[name]
        leaves |= {f"A.{name}": a, f"B.{name}": b}
    lp = torch.log_softmax(logits / temperature, -1).gather(-1, targets[:, None])[:, 0]
    (lp * coeffs).sum().backward()
    return lp.detach(), {k: t.grad for k, t in leaves.items()}


def _ours(head: nn.Module, hidden: torch.Tensor, targets, temperature, coeffs, chunk_size):
    h = hidden.clone().requires_grad_(True)
    lp, _ = head_logprobs(h, head, targets, temperature=temperature, chunk_size=chunk_size)
    assert lp.dtype == torch.float32
    (lp * coeffs).sum().backward()
    got = {"hidden": h.grad, "weight": head.base_layer.weight.grad}
    for name in head.active_adapters:
        got |= {f"A.{name}": head.lora_A[name].weight.grad}
        got |= {f"B.{name}": head.lora_B[name].weight.grad}
    return lp.detach(), got


def _case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(R, H, generator=g), torch.randint(0, V, (R,), generator=g), torch.randn(R)


def _count_fused(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = L._LinearHeadLogprobs.apply
    monkeypatch.setattr(L._LinearHeadLogprobs, "apply", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("base_trains", [False, True], ids=["frozen-base", "base-trains"])
@pytest.mark.parametrize("chunk_size", [4, 0], ids=["3-chunks", "1-chunk"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_lora_head_is_fused_and_exact(
    temperature: float, chunk_size: int, base_trains: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    head = _lora_head(seed=1)
    head.base_layer.weight.requires_grad_(base_trains)
    hidden, targets, coeffs = _case(2)
    want_lp, want = _independent(head, hidden, targets, temperature, coeffs)
    calls = _count_fused(monkeypatch)
    got_lp, got = _ours(head, hidden, targets, temperature, coeffs, chunk_size)
    assert calls == [1]
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=1e-6)
    if not base_trains:
        assert got.pop("weight") is None and want.pop("weight") is not None
    for name, grad in want.items():
        assert float(grad.abs().max()) > 1e-3, name  # a gradient that is there to compare
        torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-5, msg=name)


def test_a_disabled_adapter_leaves_the_base_head(monkeypatch: pytest.MonkeyPatch) -> None:
    head = _lora_head(seed=3)
    hidden, targets, coeffs = _case(4)
    with torch.no_grad():
        plain = nn.Linear(H, V)
        plain.load_state_dict(head.base_layer.state_dict())
    want, _ = head_logprobs(hidden, plain, targets)
    head.enable_adapters(False)  # the generic path runs the layer as peft does: base only
    calls = _count_fused(monkeypatch)
    got, _ = head_logprobs(hidden, head, targets)
    assert not calls
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("why", ["two-adapters", "dropout"])
def test_heads_the_fused_path_cannot_run_take_the_generic_one(
    why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    head = _lora_head(5, ("a", "b")) if why == "two-adapters" else _lora_head(5, dropout=0.5)
    head.eval()  # dropout off, so the independent computation sees the same logits
    hidden, targets, coeffs = _case(6)
    want_lp, want = _independent(head, hidden, targets, 0.7, coeffs)
    calls = _count_fused(monkeypatch)
    got_lp, got = _ours(head, hidden, targets, 0.7, coeffs, chunk_size=4)
    assert not calls
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=1e-6)
    for name, grad in want.items():
        if name != "weight":
            torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-5, msg=name)
