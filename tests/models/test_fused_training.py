"""The fused training kernels (fused_train_ops.c through fused_training's autograd nodes): the
RMSNorm forward/backward, the MLP's ``silu(g) * u`` forward/backward and the rotary embedding
(bit for bit), against hand-derived
values and against autograd through HF's own modules, in fp32 and bf16, on one thread and on
an OpenMP team; bad tensors are refused; FastForward's training pass through them matches its
ATen pass in values and gradients. (The ``kernels`` fixture is in this folder's conftest.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from furlong.models import fused_kernels as fk
from furlong.models import fused_training, load_model
from furlong.models.fast_forward import FastForward

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _close(got: torch.Tensor, want: torch.Tensor, roundings: int = 1, floor: float = 1e-6) -> None:
    """Within ``roundings`` roundings of ``got``'s dtype (bf16: 2^-8 relative each; fp32: a
    reordered sum's error), plus ``floor`` times the largest ``|want|`` for sums that cancel."""
    assert got.shape == want.shape
    g, w = got.double(), want.double()
    rel = roundings * 2**-8 if got.dtype == torch.bfloat16 else 2e-6
    bound = w.abs() * rel + w.abs().amax() * floor
    assert ((g - w).abs() <= bound).all(), ((g - w).abs() - bound).max()


def test_rms_norm_forward_and_backward_hand_values(kernels) -> None:
    # rows [3, 4] and [1, -1] (mean squares 12.5 and 1), weight [1, 2], eps 0.5, grad rows
    # [1, -1] and [2, 0.5]: gw = g * w, dot = mean(gw * x_hat), dx = rstd (gw - x_hat dot)
    x = torch.tensor([[3.0, 4.0], [1.0, -1.0]], requires_grad=True)
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    g = torch.tensor([[1.0, -1.0], [2.0, 0.5]])
    y = fused_training.rms_norm(x, w, 0.5, kernels)
    a, b = math.sqrt(13), math.sqrt(1.5)
    torch.testing.assert_close(y, torch.tensor([[3 / a, 8 / a], [1 / b, -2 / b]]))
    y.backward(g)
    want_dx = torch.tensor([[41 / 26 / a, -32 / 26 / a], [5 / 3 / b, 4 / 3 / b]])
    want_dw = torch.tensor([3 / a + 2 / b, -4 / a - 0.5 / b])
    torch.testing.assert_close(x.grad, want_dx)
    torch.testing.assert_close(w.grad, want_dw)


def test_silu_mul_forward_and_backward_hand_values(kernels) -> None:
    # silu(0) = 0, silu'(0) = 1/2; silu(ln 3) = ln 3 * 3/4, silu'(ln 3) = 3/4 (1 + ln 3 / 4)
    g = torch.tensor([0.0, math.log(3)], requires_grad=True)
    u = torch.tensor([5.0, 2.0], requires_grad=True)
    out = fused_training.silu_mul(g, u, kernels)
    ln3 = math.log(3)
    torch.testing.assert_close(out, torch.tensor([0.0, 2 * ln3 * 0.75]))
    out.backward(torch.tensor([2.0, -1.0]))
    torch.testing.assert_close(g.grad, torch.tensor([2 * 5 * 0.5, -2 * 0.75 * (1 + ln3 / 4)]))
    torch.testing.assert_close(u.grad, torch.tensor([0.0, -ln3 * 0.75]))


def _leaf(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).requires_grad_()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_hf_in_values_and_gradients(kernels, threads, dtype) -> None:
    """The output as HF's module in ``dtype`` rounds it; the gradients against fp64 autograd
    through HF's module on the same values (ours round once, from fp32). Rows enough for a
    team (> 64Ki elements): each thread's rows and its dw partial sum."""
    torch.manual_seed(threads)
    norm = Qwen3RMSNorm(320, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(320) + 0.5)
    x, grad = (torch.randn(3, 100, 320) * 3).to(dtype), torch.randn(3, 100, 320).to(dtype)
    exact = Qwen3RMSNorm(320, eps=1e-6).double()
    with torch.no_grad():
        exact.weight.copy_(norm.weight)
        want = norm(x)
    x_exact, x_ours = x.double().requires_grad_(), x.clone().requires_grad_()
    exact(x_exact).backward(grad.double())
    w_ours = norm.weight.detach().clone().requires_grad_()
    got = fused_training.rms_norm(x_ours, w_ours, 1e-6, kernels)
    got.backward(grad)
    _close(got, want)
    _close(x_ours.grad, x_exact.grad)
    _close(w_ours.grad, exact.weight.grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_aten_in_values_and_gradients(kernels, threads, dtype) -> None:
    """The output as ``F.silu(g) * u`` rounds it in ``dtype``; the gradients against fp64
    autograd on the same values."""
    torch.manual_seed(threads)
    g, u = (torch.randn(70_001) * 4).to(dtype), torch.randn(70_001).to(dtype)  # not a /64 split
    grad = torch.randn(70_001).to(dtype)
    want = F.silu(g) * u
    g_exact, u_exact = g.double().requires_grad_(), u.double().requires_grad_()
    (F.silu(g_exact) * u_exact).backward(grad.double())
    g_ours, u_ours = g.clone().requires_grad_(), u.clone().requires_grad_()
    got = fused_training.silu_mul(g_ours, u_ours, kernels)
    got.backward(grad)
    _close(got, want)
    g_aten, u_aten = g.clone().requires_grad_(), u.clone().requires_grad_()
    (F.silu(g_aten) * u_aten).backward(grad)
    _close(g_ours.grad, g_aten.grad)  # the roundings of ATen's two ops (exp may differ)
    _close(u_ours.grad, u_aten.grad)
    # bf16 rounds silu(g) before the product and grad * u before silu's derivative; fp64
    # rounds neither, so a bf16 result is two roundings from it
    _close(g_ours.grad, g_exact.grad, roundings=2)
    _close(u_ours.grad, u_exact.grad, roundings=2)


def test_rope_forward_and_backward_hand_values(kernels) -> None:
    # hd 4: y = x * cos + roll(x, 2) * sin with sin sign-folded [-s, -s, s, s]; cos 0.5,
    # s 2: x [1, 2, 3, 4] -> [0.5 - 6, 1 - 8, 1.5 + 2, 2 + 4]; the backward is the transpose,
    # g * cos + roll(g * sin, 2): g [1, 0, 0, 1] -> [0.5 + 0, 0 + 2, 0 - 2, 0.5 + 0]
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4).requires_grad_()
    cos = torch.full((1, 1, 1, 4), 0.5)
    sin = torch.tensor([-2.0, -2.0, 2.0, 2.0]).view(1, 1, 1, 4)
    y = fused_training.rope(x, cos, sin, kernels)
    assert y.flatten().tolist() == [-5.5, -7.0, 3.5, 6.0]
    y.backward(torch.tensor([1.0, 0.0, 0.0, 1.0]).view(1, 1, 1, 4))
    assert x.grad.flatten().tolist() == [0.5, 2.0, -2.0, 0.5]


@pytest.mark.parametrize("shared", [False, True], ids=["per-row-positions", "shared-positions"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_equals_aten_bit_for_bit(kernels, threads, dtype, shared) -> None:
    """Against fast_forward._rotate under autograd (HF's ops), values and gradients equal in
    fp32 and bf16, on a strided x and a strided gradient (SDPA's, seen through a transpose)."""
    from furlong.models.fast_forward import _rotate

    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 7, 2, 5, 16, generator=g).to(dtype)
    x_ref = base[:, :, 0].detach().requires_grad_()  # [3, 7, 5, 16], rows strided
    x_ours = base[:, :, 0].detach().requires_grad_()
    angles = torch.rand(1 if shared else 3, 7, 1, 16, generator=g) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    up = torch.randn(3, 5, 7, 16, generator=g).to(dtype).transpose(1, 2)  # strided gradient
    want = _rotate(x_ref, cos, sin)
    want.backward(up)
    got = fused_training.rope(x_ours, cos, sin, kernels)
    got.backward(up)
    assert got.is_contiguous() and torch.equal(got, want)
    assert torch.equal(x_ours.grad, x_ref.grad)
    assert float(x_ref.grad.abs().sum()) > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_team_and_one_thread_agree(kernels, dtype) -> None:
    """Rows and elements are split, never summed across threads (but dw's partial sums)."""
    x, w = torch.randn(400, 256).to(dtype), (torch.rand(256) + 0.5).to(dtype)
    grad = torch.randn(400, 256).to(dtype)
    before = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            y, rstd = kernels.rms_norm_fwd(x, w, 1e-6)
            dx, dw = kernels.rms_norm_bwd(grad, x, w, rstd)
            results.append((y, rstd, dx, dw, *kernels.silu_mul_bwd(grad, x, y)))
    finally:
        torch.set_num_threads(before)
    one, team = results
    for a, b in zip(one, team, strict=True):
        if a is one[3]:
            torch.testing.assert_close(a, b)  # dw: two partial sums, then their sum
        else:
            assert torch.equal(a, b)


def test_bad_tensors_are_refused_before_any_write(kernels) -> None:
    x, w = torch.randn(4, 8), torch.ones(8)
    y, rstd = kernels.rms_norm_fwd(x, w, 1e-6)
    cases = [
        (lambda: kernels.rms_norm_fwd(x.t(), torch.ones(4), 1e-6), "dense x"),
        (lambda: kernels.rms_norm_fwd(x, w[:4], 1e-6), "dense x"),
        (lambda: kernels.rms_norm_fwd(x, w.bfloat16(), 1e-6), "one dtype"),
        (lambda: kernels.rms_norm_bwd(y[:2], x, w, rstd), "grad like x"),
        (lambda: kernels.rms_norm_bwd(y, x, w, rstd[:2]), r"fp32 rstd \[rows\]"),
        (lambda: kernels.rms_norm_bwd(y, x, w, rstd.double()), r"fp32 rstd \[rows\]"),
        (lambda: kernels.silu_mul_fwd(x, x[:2]), "dense, alike"),
        (lambda: kernels.silu_mul_bwd(y.t(), x, x), "dense, alike"),
        (lambda: kernels.rope(x.view(1, 4, 1, 8), w.view(1, 1, 1, 8), w[:4]), "cos"),
        (lambda: kernels.rope(x.view(4, 8), w, w), "cos"),
        (lambda: kernels.rope(x.view(2, 2, 1, 8), w.view(1, 1, 1, 8), w.view(1, 1, 1, 8)), "cos"),
    ]
    before = x.clone(), y.clone()
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert torch.equal(x, before[0]) and torch.equal(y, before[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_forward_training_pass_through_kernels_equals_aten(kernels, dtype) -> None:
    """tiny-qwen3's whole training pass (input, post-attention, q/k and final norms; every MLP)
    through the kernels against the same pass on ATen's ops: hidden states and every weight's
    gradient."""
    torch.manual_seed(0)
    model, _ = load_model("tiny-qwen3")
    model.to(dtype)
    fast = FastForward(model)
    assert fast._fused() is kernels
    ids = torch.randint(1, model.config.vocab_size, (3, 9))
    mask = torch.tensor([[0, 0] + [1] * 7, [1] * 9, [0] * 6 + [1] * 3])
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    probe = torch.randn(3, 9, model.config.hidden_size)

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        h = fast.hidden(ids, mask, pos)
        (h.float() * probe).sum().backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        return h.detach(), grads

    h_ours, grads_ours = run()
    fast._fused = lambda: None  # the ATen pass
    h_ref, grads_ref = run()
    rel = 4e-3 if dtype == torch.bfloat16 else 1e-6  # measured: 5.6e-4 and 1.8e-7
    assert (h_ours.float() - h_ref.float()).norm() <= rel * h_ref.float().norm()
    assert grads_ours.keys() == grads_ref.keys()
    assert sum("norm" in name for name in grads_ref) == 4 * model.config.num_hidden_layers + 1
    rel = 0.02 if dtype == torch.bfloat16 else 1e-5  # measured at most: 4.4e-3 and 6.9e-7
    for name, want in grads_ref.items():
        got = grads_ours[name]
        err = (got - want).norm() / want.norm().clamp(min=1e-12)
        assert err <= rel, (name, err.item())
        assert want.abs().sum() > 0, name  # every weight gets a gradient: nothing masked out


def test_without_openmp_the_kernels_run_on_one_thread(kernels, monkeypatch, tmp_path) -> None:
    """A compiler that refuses -fopenmp still builds them, single-threaded, with one result."""
    x, w = torch.randn(600, 256), torch.rand(256) + 0.5
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        team = kernels.rms_norm_fwd(x, w, 1e-6)
        monkeypatch.setenv("FURLONG_CACHE", str(tmp_path))
        monkeypatch.setattr(fk, "OPENMP", "-fno-such-flag")
        fk.kernel_build.cache_clear()
        serial = fk.fused_kernels()
        assert serial is not None and serial is not kernels
        y, rstd = serial.rms_norm_fwd(x, w, 1e-6)
        dx, dw = serial.rms_norm_bwd(torch.ones_like(x), x, w, rstd)
    finally:
        torch.set_num_threads(before)
        fk.kernel_build.cache_clear()
    assert torch.equal(y, team[0]) and torch.equal(rstd, team[1])
    torch.testing.assert_close(y, torch.rms_norm(x, (256,), w, 1e-6))
    x_hat = x * rstd.unsqueeze(-1)
    torch.testing.assert_close(dw, x_hat.sum(0), rtol=1e-4, atol=1e-4)  # grad 1: sum of x_hat
