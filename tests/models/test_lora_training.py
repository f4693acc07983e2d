"""The merged LoRA training node equals peft's unmerged sum ``x W^T + b + s (x A^T) B^T``:
outputs and the gradients of x, A and B against autograd through that sum in fp64, on nonzero
B (peft starts it at 0) and a scale other than 1; a frozen input gives A and B their gradients
alone; it applies only over a frozen base in the adapter's dtype and at rows enough for the
merge to pay; FastForward's training pass takes it for a one-adapter fp32 LoRA layer and not
for a bf16 base with fp32 adapters."""

from __future__ import annotations

import pytest
import torch

from furlong.models import lora_training

pytestmark = pytest.mark.usefixtures("one_thread")


def _case(bias: bool) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(3, 5, 12, generator=g) + 0.5,
        "weight": torch.randn(7, 12, generator=g) * 0.3,
        "bias": torch.randn(7, generator=g) if bias else None,
        "lora_a": torch.randn(4, 12, generator=g) * 0.2,
        "lora_b": torch.randn(7, 4, generator=g) * 0.2,
        "up": torch.randn(3, 5, 7, generator=g),
    }


def _peft_sum(t: dict, scaling: float) -> torch.Tensor:
    base = torch.nn.functional.linear(t["x"], t["weight"], t["bias"])
    return base + torch.nn.functional.linear(t["x"] @ t["lora_a"].T, t["lora_b"]) * scaling


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_outputs_and_gradients_equal_peft_sum_in_fp64(bias: bool) -> None:
    scaling = 2.5
    case = _case(bias)
    trained = ("x", "lora_a", "lora_b")
    want = {
        k: (v.double().requires_grad_(k in trained) if v is not None else None)
        for k, v in case.items()
    }
    _peft_sum(want, scaling).backward(want["up"])
    got = {
        k: (v.clone().requires_grad_(k in trained) if v is not None else None)
        for k, v in case.items()
    }
    out = lora_training.merged_lora_linear(
        got["x"], got["weight"], got["bias"], got["lora_a"], got["lora_b"], scaling
    )
    out.backward(got["up"])
    with torch.no_grad():
        torch.testing.assert_close(out.double(), _peft_sum(want, scaling), rtol=1e-5, atol=1e-5)
    for k in trained:
        assert float(want[k].grad.abs().sum()) > 0  # nonzero gradients compared
        torch.testing.assert_close(got[k].grad.double(), want[k].grad, rtol=1e-5, atol=1e-5)


def test_hand_derived_gradients_on_a_single_row() -> None:
    # x = [1, 2], W = I, A = [[1, 1]], B = [[1], [0]], s = 3: y = x + 3 (x1 + x2) e1 = [10, 2].
    # dy = [1, 1]: dx = dy W' with W' = I + 3 B A = [[4, 3], [0, 1]] -> [4, 4];
    # dA = 3 (dy B) x = 3 * 1 * [1, 2] = [3, 6]; dB = 3 dy^T (x A^T) = 3 * [1, 1]^T * 3 = [9, 9]
    x = torch.tensor([[1.0, 2.0]], requires_grad=True)
    a = torch.tensor([[1.0, 1.0]], requires_grad=True)
    b = torch.tensor([[1.0], [0.0]], requires_grad=True)
    y = lora_training.merged_lora_linear(x, torch.eye(2), None, a, b, 3.0)
    y.backward(torch.ones(1, 2))
    assert y.tolist() == [[10.0, 2.0]]
    assert x.grad.tolist() == [[4.0, 4.0]]
    assert a.grad.tolist() == [[3.0, 6.0]]
    assert b.grad.tolist() == [[9.0], [9.0]]


def test_a_frozen_input_still_trains_the_adapter() -> None:
    case = _case(bias=False)
    a = case["lora_a"].clone().requires_grad_()
    b = case["lora_b"].clone().requires_grad_()
    out = lora_training.merged_lora_linear(case["x"], case["weight"], None, a, b, 0.5)
    out.backward(case["up"])
    a2 = case["lora_a"].clone().requires_grad_()
    b2 = case["lora_b"].clone().requires_grad_()
    _peft_sum({**case, "lora_a": a2, "lora_b": b2}, 0.5).backward(case["up"])
    torch.testing.assert_close(a.grad, a2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.grad, b2.grad, rtol=1e-5, atol=1e-6)


def test_applies_over_a_frozen_base_in_the_adapters_dtype_with_rows_enough() -> None:
    w, bias = torch.randn(6, 3), torch.randn(6)  # out 6, in 3: pays from 2 * 18 / 9 = 4 rows
    a, b = torch.randn(1, 3), torch.randn(6, 1)
    assert lora_training.applies(5, w, bias, a, b)
    assert not lora_training.applies(4, w, bias, a, b)  # W' built twice costs what it saves
    assert not lora_training.applies(5, w.requires_grad_(), None, a, b)
    assert not lora_training.applies(5, w.detach(), bias.requires_grad_(), a, b)
    assert not lora_training.applies(5, w.detach().bfloat16(), None, a, b)  # peft's fp32 A, B


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fast_trunk_merges_fp32_layers_only(dtype: torch.dtype, monkeypatch) -> None:
    from tests.train.helpers import grouped_datums
    from tests.train.test_fast_trunk import _lora_engine

    calls = []
    real = lora_training.merged_lora_linear
    monkeypatch.setattr(lora_training, "merged_lora_linear", lambda *a: calls.append(1) or real(*a))
    fast = _lora_engine(fast_forward=True, dtype=dtype)
    fast.forward_backward(grouped_datums(3), "ppo")
    layers = fast.model.get_base_model().config.num_hidden_layers
    assert len(calls) == (7 * layers if dtype == torch.float32 else 0)  # q k v o gate up down
