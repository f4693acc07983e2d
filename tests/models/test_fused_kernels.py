"""The fused CPU kernels (fused_ops.c): RMSNorm with its residual add, and Qwen3's per-head q/k
norms with the rotary embedding, against hand-derived values and HF's own modules in fp32 and
bf16; bad tensors are refused before anything is written; the library is built once into the
cache, and FastForward falls back to ATen's ops without it."""

from __future__ import annotations

import logging
import math
import shutil

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

from furlong.models import fused_kernels as fk
from furlong.models import load_model
from furlong.models.fast_forward import FastForward
from furlong.rollout import kv_cache

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: the float tolerance of a reordered sum; bf16: at most one bf16 rounding step
    (the fp32 statistics may round the other way at a tie of the bf16 grid)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double(), want.double()
    rel = 2**-7 if got.dtype == torch.bfloat16 else 1e-6
    assert ((g - w).abs() <= w.abs() * rel + 1e-6).all(), (g - w).abs().max()


def test_rms_norm_hand_values(kernels) -> None:
    # rows [3, 4] and [1, -1]: mean squares 12.5 and 1, weight [1, 2], eps 0.5
    x = torch.tensor([[3.0, 4.0], [1.0, -1.0]])
    w = torch.tensor([1.0, 2.0])
    y = kernels.rms_norm(x, w, 0.5)
    a, b = math.sqrt(13), math.sqrt(1.5)
    want = torch.tensor([[3 / a, 8 / a], [1 / b, -2 / b]])
    torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_equals_hf(kernels, dtype) -> None:
    torch.manual_seed(0)
    norm = Qwen3RMSNorm(256, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(256) + 0.5)
    h = (torch.randn(24, 256) * 3).to(dtype)
    delta = torch.randn(24, 256).to(dtype)
    want_h = h + delta
    with torch.no_grad():
        want = norm(want_h)
    got = kernels.rms_norm(h, norm.weight.detach(), 1e-6, residual=delta)
    assert torch.equal(h, want_h)  # the residual add, in place, rounded once as torch's
    _close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_a_strided_slice(kernels, dtype) -> None:
    x = torch.randn(3, 5, 64).to(dtype)  # the last position of each row, as logits_to_keep=1
    w = (torch.rand(64) + 0.5).to(dtype)
    got = kernels.rms_norm(x[:, -1:], w, 1e-6)
    _close(got, torch.rms_norm(x[:, -1:], (64,), w, 1e-6))


def _angles(rows: int, hd: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """HF's cos/sin [rows, hd], and FastForward's sin with rotate_half's sign folded in."""
    theta = torch.rand(rows, hd // 2) * 20
    ang = torch.cat([theta, theta], -1)
    sign = torch.cat([-torch.ones(hd // 2), torch.ones(hd // 2)])
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    return cos, sin, (ang.sin() * sign).to(dtype)


def test_rope_hand_values(kernels) -> None:
    # hd 2: x = [1, 0] turns to [cos t, sin t]; y = [0, 2] to [-2 sin t, 2 cos t]
    t = 0.7
    q = torch.tensor([[[1.0, 0.0]]])
    k = torch.tensor([[[0.0, 2.0]]])
    cos = torch.tensor([[math.cos(t)] * 2])
    folded = torch.tensor([[-math.sin(t), math.sin(t)]])
    kernels.qk_rope(q, k, cos, folded)
    torch.testing.assert_close(q, torch.tensor([[[math.cos(t), math.sin(t)]]]))
    torch.testing.assert_close(k, torch.tensor([[[-2 * math.sin(t), 2 * math.cos(t)]]]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False], ids=["qwen3", "llama"])
def test_qk_rope_equals_hf(kernels, dtype, with_norm) -> None:
    torch.manual_seed(1)
    rows, heads, kv_heads, hd = 7, 4, 2, 64
    q = torch.randn(rows, 1, heads, hd).to(dtype)
    k = torch.randn(rows, 1, kv_heads, hd).to(dtype)
    cos, sin, folded = _angles(rows, hd, dtype)
    q_norm, k_norm = Qwen3RMSNorm(hd, 1e-6).to(dtype), Qwen3RMSNorm(hd, 1e-5).to(dtype)
    with torch.no_grad():
        q_norm.weight.copy_(torch.rand(hd) + 0.5)
        k_norm.weight.copy_(torch.rand(hd) + 0.5)
        # HF's order: per-head norms on [rows, 1, heads, hd], then rotary on [rows, heads, 1, hd]
        qn, kn = (q_norm(q), k_norm(k)) if with_norm else (q, k)
        want_q, want_k = apply_rotary_pos_emb(
            qn.transpose(1, 2), kn.transpose(1, 2), cos[:, None], sin[:, None], unsqueeze_dim=1
        )
    norms = [(n.weight.detach(), n.variance_epsilon) for n in (q_norm, k_norm)]
    kernels.qk_rope(q, k, cos, folded, *(norms if with_norm else []))
    _close(q, want_q.transpose(1, 2))
    _close(k, want_k.transpose(1, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_rope_on_column_slices_of_one_qkv_output(kernels, dtype) -> None:
    # q and k as column slices of one [rows, (heads + 2 kv_heads) * hd] GEMM output (strided
    # rows): the same values as on dense copies, and v's columns untouched
    torch.manual_seed(2)
    rows, heads, kv_heads, hd = 5, 4, 2, 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * hd).to(dtype)
    q, k, v = qkv.split((heads * hd, kv_heads * hd, kv_heads * hd), dim=-1)
    q, k = q.view(rows, 1, heads, hd), k.view(rows, 1, kv_heads, hd)
    dense_q, dense_k, q_before, v_before = q.clone(), k.clone(), q.clone(), v.clone()
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, _, folded = _angles(rows, hd, dtype)
    norms = [((torch.rand(hd) + 0.5).to(dtype), eps) for eps in (1e-6, 1e-5)]
    kernels.qk_rope(q, k, cos, folded, *norms)
    kernels.qk_rope(dense_q, dense_k, cos, folded, *norms)
    assert dense_q.is_contiguous() and not torch.equal(q, q_before)  # rotated in place
    assert torch.equal(q, dense_q) and torch.equal(k, dense_k)
    assert torch.equal(v, v_before)


def test_bad_tensors_are_refused_before_any_write(kernels) -> None:
    q, k = torch.randn(3, 1, 4, 8), torch.randn(3, 1, 2, 8)
    cos, _, sin = _angles(3, 8, torch.float32)
    before = q.clone(), k.clone()
    w = torch.ones(8)
    cases = [
        ((q, k.double(), cos, sin), "one dtype"),
        ((q.transpose(0, 2), k, cos, sin), "dense"),
        ((q, k[:2], cos, sin), "dense"),
        ((q, k, cos[:, :4], sin), "dense"),
        ((q[:1].expand(3, 1, 4, 8), k, cos, sin), "dense"),  # rows overlap: stride 0
        ((q, torch.randn(3, 1, 8, 2).transpose(-1, -2), cos, sin), "dense"),  # heads strided
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            kernels.qk_rope(*args)
    with pytest.raises(ValueError, match="come together"):
        kernels.qk_rope(q, k, cos, sin, (w, 1e-6))
    with pytest.raises(ValueError, match=r"norm weights \[hd\]"):
        kernels.qk_rope(q, k, cos, sin, (w[:4], 1e-6), (w, 1e-6))
    with pytest.raises(ValueError, match="residual"):
        kernels.rms_norm(q.view(3, 32), torch.ones(32), 1e-6, residual=torch.ones(3, 16))
    with pytest.raises(ValueError, match="one dtype"):
        kernels.rms_norm(q.view(3, 32), torch.ones(32, dtype=torch.bfloat16), 1e-6)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


def test_built_once_into_the_cache(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("FURLONG_CACHE", str(tmp_path))
    fk.kernel_build.cache_clear()
    try:
        assert fk.fused_kernels() is not None
        (built,) = (tmp_path / "kernels").glob("fused_ops-*.so")
        stamp = built.stat().st_mtime_ns
        fk.kernel_build.cache_clear()
        assert fk.fused_kernels() is not None
        assert built.stat().st_mtime_ns == stamp  # found, not rebuilt
        assert [p.name for p in (tmp_path / "kernels").iterdir()] == [built.name]  # no temp left
    finally:
        fk.kernel_build.cache_clear()


@pytest.mark.parametrize(
    "env, level",
    [({"FURLONG_FUSED_KERNELS": "0"}, None), ({"CC": "/nonexistent/cc"}, logging.WARNING)],
    ids=["disabled", "no-compiler"],
)
def test_without_kernels_fast_forward_uses_aten(monkeypatch, tmp_path, caplog, env, level) -> None:
    monkeypatch.setenv("FURLONG_CACHE", str(tmp_path))  # nothing cached to find
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    fk.kernel_build.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=fk.__name__):
            assert fk.fused_kernels() is None
        assert level is None or any(r.levelno == level for r in caplog.records)
        model, _ = load_model("tiny-qwen3")
        ids = torch.randint(1, model.config.vocab_size, (2, 5))
        mask = torch.ones_like(ids)
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask).logits
            got = FastForward(model)(ids, mask, mask.cumsum(1) - 1, None, logits_to_keep=0)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    finally:
        fk.kernel_build.cache_clear()


def test_fast_forward_in_bf16_and_its_fallback_for_fp32_norms(kernels) -> None:
    """A bf16 model's decode steps through the kernels stay at HF's bf16 logits (the same
    roundings; SDPA and the GEMMs are shared); a norm kept in fp32 (HF then returns fp32 from
    it) sends the pass to ATen's ops instead of the kernels."""
    model, _ = load_model("tiny-qwen3")
    model.to(torch.bfloat16)
    fast = FastForward(model)
    assert fast._fused() is kernels
    ids = torch.randint(1, model.config.vocab_size, (3, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6, [0, 0, 0, 0, 0, 1]])
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    ours, ref = kv_cache.new_cache(model.config), kv_cache.new_cache(model.config)
    with torch.no_grad():
        for _ in range(4):
            got = fast(ids, mask, pos, ours)
            want = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=ref).logits[
                :, -1:
            ]
            diff = (got.float() - want.float()).abs().max().item()
            assert diff <= 2**-6 * want.float().abs().max().item(), diff  # ~2 bf16 steps
            ids = got.argmax(-1)
            mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
            pos = mask.sum(1, keepdim=True) - 1
    model.model.layers[0].post_attention_layernorm.float()
    assert fast._fused() is None
