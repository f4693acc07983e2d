"""Chunked log-probs and entropy with a delayed fp32 upcast (contract (c)).

References are computed independently with plain ``torch.log_softmax`` over the whole tensor
(or in float64), never through ``furlong.train.logprobs``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import furlong.train.logprobs as L
from furlong.train.logprobs import (
    chunk_slices,
    entropy_kernel,
    graph_connected_zero,
    head_logprobs,
    log_softmax_gather,
    upcast,
)
from tests.train.logprob_reference import token_entropy, token_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ref_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """Upcast the whole tensor, then scale, then log-softmax and gather."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    logp = torch.log_softmax(z, dim=-1)
    if targets.dim() == 1:
        return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp.gather(-1, targets)


def _ref_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """-sum p log p with p = softmax(x / T), computed from probabilities (not log_softmax)."""
    z = logits.double() / temperature
    p = torch.exp(z - z.max(-1, keepdim=True).values)
    p = p / p.sum(-1, keepdim=True)
    return -(p * torch.log(p)).sum(-1)


# ---------------------------------------------------------------------------------------------
# chunk_slices
# ---------------------------------------------------------------------------------------------
def _sizes(slices: list[slice]) -> list[int]:
    return [s.stop - s.start for s in slices]


def test_chunk_slices_examples():
    assert _sizes(chunk_slices(5, 2)) == [2, 2, 1]
    assert chunk_slices(5, 0) == [slice(0, 5)]
    assert chunk_slices(5, -3) == [slice(0, 5)]
    assert chunk_slices(0, 4) == [slice(0, 0)]
    assert chunk_slices(0, 0) == [slice(0, 0)]
    assert chunk_slices(4, 4) == [slice(0, 4)]
    assert chunk_slices(3, 10) == [slice(0, 3)]


def test_chunk_slices_sweep():
    for rows in range(1, 41):
        for c in range(1, 13):
            slices = chunk_slices(rows, c)
            sizes = _sizes(slices)
            assert len(slices) == math.ceil(rows / c)
            assert max(sizes) <= c and min(sizes) >= 1
            assert max(sizes) - min(sizes) <= 1, (rows, c, sizes)
            # Contiguous, in order, covering 0..rows.
            assert slices[0].start == 0 and slices[-1].stop == rows
            for a, b in zip(slices, slices[1:], strict=False):
                assert a.stop == b.start


# ---------------------------------------------------------------------------------------------
# The kernel sees fp32 chunks; the upcast is a copy
# ---------------------------------------------------------------------------------------------
def _spy(monkeypatch) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    seen: list[tuple[torch.dtype, tuple[int, ...]]] = []
    original = L.log_softmax_gather

    def spy(z, targets):
        seen.append((z.dtype, tuple(z.shape)))
        return original(z, targets)

    monkeypatch.setattr(L, "log_softmax_gather", spy)
    return seen


def test_spy_kernel_receives_fp32_chunks(monkeypatch):
    seen = _spy(monkeypatch)
    logits = torch.randn(5, 8, generator=_gen(0)).bfloat16()
    targets = torch.tensor([0, 3, 7, 1, 5])
    out = token_logprobs(logits, targets, chunk_size=2)
    assert seen == [(torch.float32, (2, 8)), (torch.float32, (2, 8)), (torch.float32, (1, 8))]
    assert out.dtype == torch.float32 and out.shape == (5,)
    torch.testing.assert_close(out, _ref_logprobs(logits, targets), rtol=0, atol=0)

    # Under autograd each chunk is recomputed in backward: the same fp32 chunk shapes again
    # (in the order the autograd engine reaches them, typically the last chunk first).
    seen.clear()
    x = logits.clone().requires_grad_(True)
    token_logprobs(x, targets, chunk_size=2).sum().backward()
    assert seen[:3] == [(torch.float32, (2, 8)), (torch.float32, (2, 8)), (torch.float32, (1, 8))]
    assert sorted(seen[3:], key=str) == sorted(seen[:3], key=str)


def test_upcast_is_a_copy_even_from_fp32():
    x = torch.randn(4, 6, generator=_gen(1))
    for t in (1.0, 0.5):
        z = upcast(x, t)
        assert z.dtype == torch.float32
        assert z.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        z.add_(1.0)  # an in-place kernel on the copy must not touch the input
    torch.testing.assert_close(upcast(x, 1.0), x, rtol=0, atol=0)
    torch.testing.assert_close(upcast(x, 0.5), x / 0.5, rtol=0, atol=0)
    torch.testing.assert_close(
        upcast(x.bfloat16(), 0.5), x.bfloat16().float() / 0.5, rtol=0, atol=0
    )
    # temperature <= 0 means "no scaling".
    torch.testing.assert_close(upcast(x, 0.0), x, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_logits_unchanged_after_forward_and_backward(dtype):
    logits = (torch.randn(9, 11, generator=_gen(2)) * 3).to(dtype).requires_grad_(True)
    before = logits.detach().clone()
    targets = torch.randint(0, 11, (9,), generator=_gen(3))
    lp = token_logprobs(logits, targets, temperature=0.7, chunk_size=4)
    ent = token_entropy(logits, temperature=0.7, chunk_size=4, grad=True)
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(logits.detach(), before)
    # The fused head path scales its private matmul output in place: inputs stay intact too.
    hidden = torch.randn(9, 5, generator=_gen(4), requires_grad=True)
    head = nn.Linear(5, 11)
    snapshot = [hidden.detach().clone(), head.weight.detach().clone(), head.bias.detach().clone()]
    lp, _ = head_logprobs(hidden, head, targets, temperature=0.7, chunk_size=4, entropy="metric")
    lp.sum().backward()
    for t, b in zip([hidden, head.weight, head.bias], snapshot, strict=True):
        assert torch.equal(t.detach(), b)


# ---------------------------------------------------------------------------------------------
# Precision and parity
# ---------------------------------------------------------------------------------------------
def test_temperature_in_fp32():
    logits = (torch.randn(13, 40, generator=_gen(5)) * 10).bfloat16()
    targets = torch.randint(0, 40, (13,), generator=_gen(6))
    low = token_logprobs(logits, targets, temperature=0.7, chunk_size=4)
    high = token_logprobs(logits.float(), targets, temperature=0.7, chunk_size=4)
    assert low.dtype == high.dtype == torch.float32
    torch.testing.assert_close(low, high, rtol=0, atol=1e-6)
    # Contrast: dividing in bf16 (the pitfall) rounds the quotient and is measurably off.
    naive = torch.log_softmax((logits / 0.7).float(), -1).gather(-1, targets[:, None])[:, 0]
    assert (naive - high).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_parity_upcast_whole_vs_chunked_bit_equal(dtype):
    R, V, T = 23, 37, 0.8
    base = torch.randn(R, V, generator=_gen(7)) * 4
    targets = torch.randint(0, V, (R,), generator=_gen(8))
    coeffs = torch.randn(R, generator=_gen(9))  # nonuniform upstream gradient

    ref_x = base.to(dtype).requires_grad_(True)
    ref = _ref_logprobs(ref_x, targets, T)
    (ref * coeffs).sum().backward()

    x = base.to(dtype).requires_grad_(True)
    out = token_logprobs(x, targets, temperature=T, chunk_size=7)
    (out * coeffs).sum().backward()

    assert out.dtype == torch.float32
    assert torch.equal(out, ref)
    assert x.grad.dtype == dtype
    assert torch.equal(x.grad, ref_x.grad)


@pytest.mark.parametrize("two_d", [False, True], ids=["1d", "2d"])
def test_chunked_vs_unchunked_fp32(two_d):
    R, V, T = 19, 29, 0.9
    base = torch.randn(R, V, generator=_gen(10)) * 3
    shape = (R, 3) if two_d else (R,)
    targets = torch.randint(0, V, shape, generator=_gen(11))
    coeffs = torch.randn(shape, generator=_gen(12))
    ent_coeffs = torch.randn(R, generator=_gen(13))

    results = []
    for c in (0, 4, 5, 19, 100):
        x = base.clone().requires_grad_(True)
        lp = token_logprobs(x, targets, temperature=T, chunk_size=c)
        ent = token_entropy(x, temperature=T, chunk_size=c, grad=True)
        assert lp.shape == shape and ent.shape == (R,)
        (gl,) = torch.autograd.grad((lp * coeffs).sum(), x)
        (ge,) = torch.autograd.grad((ent * ent_coeffs).sum(), x)
        results.append((lp.detach(), ent.detach(), gl, ge))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)

    # And against the independent computation.
    x = base.clone().requires_grad_(True)
    ref = _ref_logprobs(x, targets, T)
    (g_ref,) = torch.autograd.grad((ref * coeffs).sum(), x)
    torch.testing.assert_close(results[1][0], ref.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(results[1][2], g_ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("recompute", [True, False])
def test_model_precision_vs_fp32_copy(recompute):
    for dtype in (torch.bfloat16, torch.float16):
        x = (torch.randn(17, 31, generator=_gen(14)) * 5).to(dtype).requires_grad_(True)
        x32 = x.detach().float().requires_grad_(True)
        targets = torch.randint(0, 31, (17,), generator=_gen(15))
        coeffs = torch.randn(17, generator=_gen(16))
        lp = token_logprobs(x, targets, chunk_size=5, recompute=recompute)
        lp32 = token_logprobs(x32, targets, chunk_size=5, recompute=recompute)
        torch.testing.assert_close(lp, lp32, rtol=0, atol=1e-6)
        ent = token_entropy(x, chunk_size=5, recompute=recompute)
        ent32 = token_entropy(x32, chunk_size=5, recompute=recompute)
        torch.testing.assert_close(ent, ent32, rtol=0, atol=1e-6)
        (lp * coeffs).sum().backward()
        (lp32 * coeffs).sum().backward()
        # The low-precision gradient is the fp32 gradient rounded once to the model dtype.
        assert x.grad.dtype == dtype
        torch.testing.assert_close(x.grad, x32.grad.to(dtype), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Entropy
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_entropy_matches_independent(temperature):
    logits = torch.randn(11, 23, generator=_gen(17)) * 4
    ent = token_entropy(logits, temperature=temperature, chunk_size=3)
    assert ent.dtype == torch.float32
    torch.testing.assert_close(ent.double(), _ref_entropy(logits, temperature), rtol=0, atol=1e-5)
    torch.testing.assert_close(
        entropy_kernel(logits / temperature).double(),
        _ref_entropy(logits, temperature),
        rtol=0,
        atol=1e-5,
    )
    # Hand check: uniform rows have entropy ln V; a near one-hot row has ~0.
    flat = torch.zeros(2, 8)
    flat[1, 3] = 100.0
    torch.testing.assert_close(
        token_entropy(flat), torch.tensor([math.log(8), 0.0]), rtol=0, atol=1e-5
    )


def test_entropy_gradient_matches_independent():
    base = torch.randn(10, 17, generator=_gen(18)) * 2
    coeffs = torch.randn(10, generator=_gen(19))
    x = base.clone().requires_grad_(True)
    ent = token_entropy(x, temperature=0.8, chunk_size=3, grad=True)
    (ent * coeffs).sum().backward()
    xd = base.double().requires_grad_(True)
    (_ref_entropy(xd, 0.8) * coeffs.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=0, atol=1e-5)


def test_entropy_metric_builds_no_graph():
    x = torch.randn(6, 9, generator=_gen(20), requires_grad=True)
    for recompute in (True, False):
        ent = token_entropy(x, chunk_size=2, recompute=recompute)
        assert not ent.requires_grad and ent.grad_fn is None
        assert token_entropy(x, chunk_size=2, recompute=recompute, grad=True).requires_grad
    with torch.no_grad():
        assert not token_entropy(x, chunk_size=2, grad=True).requires_grad


# ---------------------------------------------------------------------------------------------
# Empty slices and the graph-connected zero
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_empty_slice_outputs_are_fp32(dtype):
    logits = torch.randn(4, 7).to(dtype)[:0].requires_grad_(True)
    for c in (0, 3):
        lp = token_logprobs(logits, torch.zeros(0, dtype=torch.long), chunk_size=c)
        assert lp.dtype == torch.float32 and lp.shape == (0,)
        lp2 = token_logprobs(logits, torch.zeros(0, 2, dtype=torch.long), chunk_size=c)
        assert lp2.dtype == torch.float32 and lp2.shape == (0, 2)
        ent = token_entropy(logits, chunk_size=c)
        assert ent.dtype == torch.float32 and ent.shape == (0,)

    hidden = torch.zeros(0, 5, dtype=dtype, requires_grad=True)
    linear = nn.Linear(5, 7).to(dtype)
    for head in (linear, nn.Sequential(linear)):
        for entropy in ("none", "metric", "grad"):
            lp, ent = head_logprobs(
                hidden, head, torch.zeros(0, dtype=torch.long), chunk_size=3, entropy=entropy
            )
            assert lp.dtype == torch.float32 and lp.shape == (0,)
            if entropy == "none":
                assert ent is None
            else:
                assert ent.dtype == torch.float32 and ent.shape == (0,)


def test_graph_connected_zero_fp16_large_logits():
    logits = torch.full((4, 16), 60000.0, dtype=torch.float16, requires_grad=True)
    # Contrast: the naive half-precision placeholder overflows (sum = inf) and 0 * inf = NaN.
    naive = logits.sum() * 0
    assert naive.dtype == torch.float16 and torch.isnan(naive)

    zero = graph_connected_zero(logits)
    assert zero.dtype == torch.float32 and zero.dim() == 0
    assert zero.item() == 0.0 and zero.requires_grad
    zero.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


# ---------------------------------------------------------------------------------------------
# head_logprobs: fused nn.Linear path and generic path
# ---------------------------------------------------------------------------------------------
R_, H_, V_ = 10, 8, 50


def _head_case(bias: bool, two_d: bool, seed: int = 21):
    g = _gen(seed)
    lin = nn.Linear(H_, V_, bias=bias)
    with torch.no_grad():
        # Logits of O(1): fp32 log-probs of O(1) make an absolute 1e-6 meaningful.
        lin.weight.copy_(torch.randn(V_, H_, generator=g) * 0.3)
        if bias:
            lin.bias.copy_(torch.randn(V_, generator=g) * 0.5)
    hidden = torch.randn(R_, H_, generator=g)
    shape = (R_, 3) if two_d else (R_,)
    targets = torch.randint(0, V_, shape, generator=g)
    coeffs = torch.randn(shape, generator=g)
    return lin, hidden, targets, coeffs


def _independent(hidden, lin, targets, temperature, coeffs, extra=None):
    """Full logits via an explicit matmul; grads w.r.t. hidden, weight, bias."""
    h = hidden.clone().requires_grad_(True)
    w = lin.weight.detach().clone().requires_grad_(True)
    b = lin.bias.detach().clone().requires_grad_(True) if lin.bias is not None else None
    logits = h @ w.T + (b if b is not None else 0)
    if extra is not None:
        logits = logits + extra(h)
    lp = _ref_logprobs(logits, targets, temperature)
    ent = _ref_entropy(logits.detach(), temperature).float()
    (lp * coeffs).sum().backward()
    return lp.detach(), ent, h.grad, w.grad, (b.grad if b is not None else None)


def _run_head(head, lin, hidden, targets, coeffs, **kw):
    lin.zero_grad(set_to_none=True)
    h = hidden.clone().requires_grad_(True)
    lp, ent = head_logprobs(h, head, targets, **kw)
    assert lp.dtype == torch.float32 and lp.shape == targets.shape
    (lp * coeffs).sum().backward()
    return (
        lp.detach(),
        ent,
        h.grad,
        lin.weight.grad,
        (lin.bias.grad if lin.bias is not None else None),
    )


def _assert_grads(got, ref):
    for a, b in zip(got[2:], ref[2:], strict=True):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("two_d", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_head_logprobs_fused_linear(bias, temperature, two_d, monkeypatch):
    lin, hidden, targets, coeffs = _head_case(bias, two_d)
    ref = _independent(hidden, lin, targets, temperature, coeffs)

    calls = []
    original = L._LinearHeadLogprobs.apply

    def spy(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(L._LinearHeadLogprobs, "apply", spy)
    got = _run_head(
        lin, lin, hidden, targets, coeffs, temperature=temperature, chunk_size=3, entropy="metric"
    )
    assert calls, "nn.Linear with recompute and a metric entropy takes the fused path"
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-6)
    ent = got[1]
    assert ent.dtype == torch.float32 and not ent.requires_grad
    torch.testing.assert_close(ent, ref[1], rtol=0, atol=1e-5)
    _assert_grads(got, ref)

    # entropy="none" gives the same log-probs and no entropy.
    calls.clear()
    got_none = _run_head(lin, lin, hidden, targets, coeffs, temperature=temperature, chunk_size=3)
    assert calls and got_none[1] is None
    torch.testing.assert_close(got_none[0], ref[0], rtol=0, atol=1e-6)
    _assert_grads(got_none, ref)


def test_head_logprobs_fused_weight_only_grad():
    # Only the head's parameters need grad (hidden is a constant): still correct.
    lin, hidden, targets, coeffs = _head_case(True, False, seed=22)
    ref = _independent(hidden, lin, targets, 0.7, coeffs)
    lp, _ = head_logprobs(hidden, lin, targets, temperature=0.7, chunk_size=4)
    (lp * coeffs).sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref[3], rtol=0, atol=1e-5)
    torch.testing.assert_close(lin.bias.grad, ref[4], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["fused", "generic"])
def test_head_logprobs_duplicate_2d_targets(kind):
    # The same token twice in a row's targets: its gradient contributions must add up.
    lin, hidden, _, _ = _head_case(True, True, seed=28)
    targets = torch.tensor([[4, 4, 9]] * R_)
    coeffs = torch.randn(R_, 3, generator=_gen(29))
    ref = _independent(hidden, lin, targets, 0.7, coeffs)
    head = lin if kind == "fused" else nn.Sequential(lin)
    got = _run_head(head, lin, hidden, targets, coeffs, temperature=0.7, chunk_size=3)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-6)
    _assert_grads(got, ref)


def test_head_logprobs_generic_params_only_grad():
    # Hidden is a constant; only the (LoRA-like) head's parameters need grad. The checkpoint
    # must still propagate to parameters captured by the head.
    lin, hidden, targets, coeffs = _head_case(True, False, seed=34)
    a = (torch.randn(2, H_, generator=_gen(35)) * 0.3).requires_grad_(True)
    b = (torch.randn(V_, 2, generator=_gen(36)) * 0.3).requires_grad_(True)
    lp, _ = head_logprobs(
        hidden, lambda h: lin(h) + (h @ a.T) @ b.T, targets, temperature=0.7, chunk_size=3
    )
    (lp * coeffs).sum().backward()
    a2, b2 = a.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    w2 = lin.weight.detach().clone().requires_grad_(True)
    logits = hidden @ w2.T + lin.bias.detach() + (hidden @ a2.T) @ b2.T
    (_ref_logprobs(logits, targets, 0.7) * coeffs).sum().backward()
    for got, want in ((a.grad, a2.grad), (b.grad, b2.grad), (lin.weight.grad, w2.grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["fused", "generic"])
def test_head_logprobs_empty_backward(kind):
    lin = nn.Linear(H_, V_)
    head = lin if kind == "fused" else nn.Sequential(lin)
    hidden = torch.zeros(0, H_, requires_grad=True)
    lp, _ = head_logprobs(hidden, head, torch.zeros(0, dtype=torch.long), chunk_size=3)
    (lp.sum() + graph_connected_zero(hidden)).backward()
    assert hidden.grad.shape == (0, H_)
    assert torch.equal(lin.weight.grad, torch.zeros_like(lin.weight))


def _lora_like(lin: nn.Linear, seed: int = 23):
    g = _gen(seed)
    a = torch.randn(2, H_, generator=g) * 0.3
    b = torch.randn(V_, 2, generator=g) * 0.3

    def head(h):
        return lin(h) + (h @ a.T) @ b.T

    return head, (lambda h: (h @ a.T) @ b.T)


@pytest.mark.parametrize("two_d", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("kind", ["sequential", "lora", "linear-norecompute"])
def test_head_logprobs_generic_path(kind, temperature, two_d, monkeypatch):
    lin, hidden, targets, coeffs = _head_case(True, two_d, seed=24)
    extra = None
    recompute = True
    if kind == "sequential":
        head = nn.Sequential(lin)
    elif kind == "lora":
        head, extra = _lora_like(lin)
    else:
        head, recompute = lin, False
    ref = _independent(hidden, lin, targets, temperature, coeffs, extra=extra)

    def fused_forbidden(*args):
        raise AssertionError("the generic path must not use the fused function")

    monkeypatch.setattr(L._LinearHeadLogprobs, "apply", fused_forbidden)
    for entropy in ("none", "metric"):
        got = _run_head(
            head,
            lin,
            hidden,
            targets,
            coeffs,
            temperature=temperature,
            chunk_size=3,
            recompute=recompute,
            entropy=entropy,
        )
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-6)
        if entropy == "none":
            assert got[1] is None
        else:
            assert not got[1].requires_grad
            torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-5)
        _assert_grads(got, ref)


@pytest.mark.parametrize("head_kind", ["linear", "sequential"])
@pytest.mark.parametrize("recompute", [True, False])
def test_head_logprobs_entropy_grad(head_kind, recompute, monkeypatch):
    lin, hidden, targets, _ = _head_case(True, False, seed=25)
    head = lin if head_kind == "linear" else nn.Sequential(lin)
    T = 0.7
    lp_c = torch.randn(R_, generator=_gen(26))
    ent_c = torch.randn(R_, generator=_gen(27))

    # Independent: float64 entropy of the full logits plus the log-prob term.
    h = hidden.double().requires_grad_(True)
    w = lin.weight.detach().double().requires_grad_(True)
    b = lin.bias.detach().double().requires_grad_(True)
    logits = h @ w.T + b
    lp_ref = torch.log_softmax(logits / T, -1).gather(-1, targets[:, None])[:, 0]
    ent_ref = _ref_entropy(logits, T)
    ((lp_ref * lp_c.double()).sum() + (ent_ref * ent_c.double()).sum()).backward()

    def fused_forbidden(*args):
        raise AssertionError("entropy='grad' takes the generic path")

    monkeypatch.setattr(L._LinearHeadLogprobs, "apply", fused_forbidden)
    hh = hidden.clone().requires_grad_(True)
    lp, ent = head_logprobs(
        hh, head, targets, temperature=T, chunk_size=3, recompute=recompute, entropy="grad"
    )
    assert ent.requires_grad
    torch.testing.assert_close(ent.detach().double(), ent_ref.detach(), rtol=0, atol=1e-5)
    ((lp * lp_c).sum() + (ent * ent_c).sum()).backward()
    torch.testing.assert_close(hh.grad.double(), h.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(lin.weight.grad.double(), w.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(lin.bias.grad.double(), b.grad, rtol=0, atol=1e-5)


def test_log_softmax_gather_kernel_hand_values():
    # Row [0, ln 3]: softmax = [1/4, 3/4].
    z = torch.tensor([[0.0, math.log(3.0)]])
    torch.testing.assert_close(
        log_softmax_gather(z, torch.tensor([1])), torch.tensor([math.log(0.75)]), rtol=0, atol=1e-7
    )
    torch.testing.assert_close(
        log_softmax_gather(z, torch.tensor([[0, 1]])),
        torch.tensor([[math.log(0.25), math.log(0.75)]]),
        rtol=0,
        atol=1e-7,
    )
    # Entropy of [1/4, 3/4]: -(1/4 ln 1/4 + 3/4 ln 3/4).
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(entropy_kernel(z), torch.tensor([h]), rtol=0, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Saved-for-backward memory
# ---------------------------------------------------------------------------------------------
def _saved_bytes(fn, inputs) -> tuple[int, int, object]:
    """Bytes saved for backward while ``fn`` runs its forward.

    Returns ``(raw, extra, out)``: ``raw`` counts every saved tensor at its own size (views of
    an input included); ``extra`` counts each distinct storage once, leaving out the storages of
    ``inputs`` (which exist anyway): the memory the graph keeps alive beyond its inputs.
    """
    raw = [0]
    storages: dict[int, int] = {}

    def pack(t):
        raw[0] += t.numel() * t.element_size()
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    own = {t.untyped_storage().data_ptr() for t in inputs}
    extra = sum(n for ptr, n in storages.items() if ptr not in own)
    return raw[0], extra, out


def test_recompute_saves_fewer_bytes_token_logprobs():
    R, V, C = 64, 1000, 16
    base = torch.randn(R, V, generator=_gen(30))
    targets = torch.randint(0, V, (R,), generator=_gen(31))
    coeffs = torch.randn(R, generator=_gen(32))
    full = R * V * 4
    grads, raw, extra = {}, {}, {}
    for recompute in (False, True):
        x = base.clone().requires_grad_(True)
        raw[recompute], extra[recompute], lp = _saved_bytes(
            lambda x=x, r=recompute: token_logprobs(
                x, targets, temperature=0.9, chunk_size=C, recompute=r
            ),
            (x, targets),
        )
        (lp * coeffs).sum().backward()
        grads[recompute] = x.grad
    # Without recompute every chunk's fp32 log-softmax output is kept: R x V x 4 beyond inputs.
    assert extra[False] >= full
    # With recompute only the inputs (the chunk views of the logits and targets) are saved.
    assert raw[True] <= full + R * 8
    assert extra[True] <= full // 100
    assert torch.equal(grads[True], grads[False])

    # The same holds for a differentiable entropy.
    for recompute in (False, True):
        x = base.clone().requires_grad_(True)
        _, nbytes, _ = _saved_bytes(
            lambda x=x, r=recompute: token_entropy(x, chunk_size=C, recompute=r, grad=True),
            (x,),
        )
        if recompute:
            assert nbytes <= full // 100
        else:
            assert nbytes >= full


def test_recompute_saves_fewer_bytes_head_logprobs():
    R, H, V, C = 64, 32, 1000, 16
    g = _gen(33)
    lin = nn.Linear(H, V)
    hidden = torch.randn(R, H, generator=g)
    targets = torch.randint(0, V, (R,), generator=g)
    coeffs = torch.randn(R, generator=g)
    full = R * V * 4
    grads, raw, extra = {}, {}, {}
    for name, head, recompute in (
        ("fused", lin, True),
        ("generic-recompute", nn.Sequential(lin), True),
        ("generic-plain", nn.Sequential(lin), False),
    ):
        lin.zero_grad(set_to_none=True)
        h = hidden.clone().requires_grad_(True)
        raw[name], extra[name], (lp, _) = _saved_bytes(
            lambda h=h, head=head, r=recompute: head_logprobs(
                h, head, targets, chunk_size=C, recompute=r, temperature=0.9
            ),
            (h, targets, lin.weight, lin.bias),
        )
        (lp * coeffs).sum().backward()
        grads[name] = (h.grad, lin.weight.grad, lin.bias.grad)

    # Fused: exactly hidden + weight + bias + targets + one fp32 log-sum-exp per row.
    assert raw["fused"] == R * H * 4 + (V * H + V) * 4 + R * 8 + R * 4
    assert extra["fused"] == R * 4
    # Generic without recompute keeps the fp32 log-softmax of every chunk (and more).
    assert extra["generic-plain"] >= full
    assert extra["generic-recompute"] <= full // 100
    for name in ("generic-recompute", "generic-plain"):
        for a, b in zip(grads["fused"], grads[name], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_one_chunk_keeps_its_softmax_for_backward(monkeypatch):
    """A single chunk's softmax is kept, so backward runs no second head GEMM; a retained
    graph's second backward recomputes it (the kept one was spent in place) and agrees."""
    lin, hidden, targets, coeffs = _head_case(True, False, seed=40)
    ref = _independent(hidden, lin, targets, 0.7, coeffs)
    heads = []
    real = L._ChunkWorkspace.fp32_logits
    monkeypatch.setattr(L._ChunkWorkspace, "fp32_logits", lambda *a: heads.append(1) or real(*a))
    for chunk_size, passes in ((0, 1), (4, 2 * len(L.chunk_slices(R_, 4)))):
        heads.clear()
        got = _run_head(lin, lin, hidden, targets, coeffs, temperature=0.7, chunk_size=chunk_size)
        assert len(heads) == passes
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-6)
        _assert_grads(got, ref)
    h = hidden.clone().requires_grad_(True)
    lp, _ = head_logprobs(h, lin, targets, temperature=0.7, chunk_size=0)
    first = torch.autograd.grad((lp * coeffs).sum(), h, retain_graph=True)[0]
    second = torch.autograd.grad((lp * coeffs).sum(), h)[0]
    torch.testing.assert_close(first, ref[2], rtol=0, atol=1e-5)
    torch.testing.assert_close(second, first, rtol=0, atol=1e-6)
