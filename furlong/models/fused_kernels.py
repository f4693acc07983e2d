"""Fused CPU kernels for :class:`~furlong.models.fast_forward.FastForward`'s passes.

Inference (``fused_ops.c``): a small model's decode step on CPU spends more time in ATen's
per-op overhead than in its elementwise arithmetic: ``torch.rms_norm`` is ~8 ops, Qwen3's
per-head q/k norms and the two rotary embeddings are ~25 more per layer. Each group is one pass
here: the residual add with the RMSNorm after it, and the q/k norms with the rotary embedding
(in place). Training (``fused_train_ops.c``): an RMSNorm forward that keeps each row's rstd and
its backward, the MLP's ``silu(g) * u`` and the rotary embedding forward and backward (the
last bit for bit, as it has no sum), each one pass over memory
instead of 2-8, split over ``torch.get_num_threads()`` threads. All round where HF's modules
round (fp32, or bf16 with fp32 statistics), so results stay within the float tolerance of the
HF forward's, not bit-identical (sums run in another order, ``exp`` is a polynomial).

The library is compiled on first use with the system C compiler (``$CC``, else ``cc``) for
this CPU (``-march=native``) and cached under ``<cache>/kernels/`` (``<cache>``: as for the
pretrained models), keyed by the source, flags, compiler and CPU. Without a compiler, when the
build fails, or with ``FURLONG_FUSED_KERNELS=0``, :func:`fused_kernels` is None and
FastForward runs the same ops through ATen. These are raw kernels: the autograd nodes over
the training ones are in :mod:`furlong.models.fused_training`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from ctypes import c_float, c_int, c_int64, c_void_p
from pathlib import Path
from typing import Any

import torch

from furlong.atomic import replacing
from furlong.models.pretrained import cache_root
from furlong.package_data import package_file

log = logging.getLogger(__name__)

SOURCES = (package_file("models/fused_ops.c"), package_file("models/fused_train_ops.c"))
HEADER = package_file("models/fused_ops.h")
# no -ffast-math and no FMA contraction: each float op rounds as written
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC")
# the training kernels' threads; a compiler without OpenMP builds them single-threaded
OPENMP = "-fopenmp"
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
MAX_HEAD_DIM = 1024  # fused_ops.c's scratch row
_SERIAL_BELOW = 1 << 16  # elements: smaller calls run on the calling thread alone


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def _build(compiler: str, flags: tuple[str, ...]) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    key = hashlib.sha256(
        "\0".join(
            [
                *(f.read_text() for f in (*SOURCES, HEADER)),
                *flags,
                version,
                platform.machine(),
                _cpu_flags(),
            ]
        ).encode()
    ).hexdigest()[:16]
    path = cache_root() / "kernels" / f"fused_ops-{key}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path) as tmp:  # concurrent builders each rename a whole library
            subprocess.run(
                [compiler, *flags, "-o", str(tmp), *map(str, SOURCES)],
                capture_output=True,
                text=True,
                check=True,
                timeout=120,
            )
    return path


def fused_kernels() -> FusedKernels | None:
    """The compiled kernels, or None (disabled, no compiler, or a failed build: logged once)."""
    return kernel_build()[0]


@functools.cache
def kernel_build() -> tuple[FusedKernels | None, str]:
    """The compiled kernels and the library's path, or None and why not (logged once)."""
    if os.environ.get("FURLONG_FUSED_KERNELS", "1") == "0":
        return None, "off (FURLONG_FUSED_KERNELS=0)"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: FastForward keeps ATen's ops for its norms and rotary")
        return None, "no C compiler ($CC, cc or gcc)"
    lost = [str(f) for f in (*SOURCES, HEADER) if not f.is_file()]
    if lost:  # not this machine's doing: the install left out package data
        why = f"furlong's package is incomplete (reinstall it): {lost} missing"
        log.error("%s; using ATen's ops", why)
        return None, why
    try:
        try:
            path = _build(compiler, (*FLAGS, OPENMP))
        except subprocess.CalledProcessError:
            path = _build(compiler, FLAGS)
        return FusedKernels(ctypes.CDLL(str(path))), str(path)
    except (OSError, subprocess.SubprocessError) as e:
        detail = str(getattr(e, "stderr", "") or e)[-500:]
        log.warning("fused CPU kernels unavailable, using ATen's ops: %s", detail)
        return None, f"build failed: {detail}"


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedKernels:
    """Typed entry points to ``fused_ops.c``; every tensor is checked before its pointer goes
    to C (a wrong stride there would write outside the tensor)."""

    def __init__(self, lib: ctypes.CDLL):
        self._rms: dict[torch.dtype, Any] = {}  # dtype -> its C function
        self._rope: dict[torch.dtype, Any] = {}
        for dtype, name in DTYPES.items():
            rms = getattr(lib, f"rms_norm_{name}")
            rms.argtypes = [c_void_p, c_int64, c_void_p, c_int64, c_void_p, c_void_p]
            rms.argtypes += [c_int64, c_int64, c_float]
            rope = getattr(lib, f"qk_rope_{name}")
            rope.argtypes = [c_void_p] * 6 + [c_int64] * 6 + [c_float, c_float]
            rms.restype = rope.restype = None
            self._rms[dtype], self._rope[dtype] = rms, rope
        self._train: dict[tuple[str, torch.dtype], Any] = {}  # (kernel, dtype) -> C function
        for dtype, name in DTYPES.items():
            for kernel, args in (
                ("rms_norm_fwd", [c_void_p] * 4 + [c_int64, c_int64, c_float, c_int]),
                ("rms_norm_bwd", [c_void_p] * 6 + [c_int64, c_int64, c_int]),
                ("silu_mul_fwd", [c_void_p] * 3 + [c_int64, c_int]),
                ("silu_mul_bwd", [c_void_p] * 5 + [c_int64, c_int]),
                ("rope", [c_void_p] * 4 + [c_int64] * 8 + [c_int, c_int]),
            ):
                fn = getattr(lib, f"{kernel}_{name}")
                fn.argtypes, fn.restype = args, None
                self._train[kernel, dtype] = fn

    @staticmethod
    def takes(dtype: torch.dtype) -> bool:
        """Whether CPU tensors of ``dtype`` have kernels."""
        return dtype in DTYPES

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``weight * x_hat`` over the last dim, as HF's RMSNorm; with ``residual``, ``x`` (then
        contiguous) first becomes ``x + residual`` in place, the decoder's residual add."""
        if residual is None:
            x = x.contiguous()  # a no-op but for a slice such as the last position's rows
        else:
            _check(residual.shape == x.shape and residual.is_contiguous(), "residual", residual)
            _same(x, residual)
        n = x.shape[-1]
        _same(x, weight)
        _check(x.is_contiguous() and weight.shape == (n,) and weight.is_contiguous(), "x, w", x)
        y = torch.empty_like(x)
        self._rms[x.dtype](
            x.data_ptr(),
            n,
            _ptr(residual),
            n,
            weight.data_ptr(),
            y.data_ptr(),
            x.numel() // n,
            n,
            eps,
        )
        return y

    def qk_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_norm: tuple[torch.Tensor, float] | None = None,
        k_norm: tuple[torch.Tensor, float] | None = None,
    ) -> None:
        """In place on ``q [..., heads, hd]`` and ``k [..., kv_heads, hd]``: the optional
        per-head RMSNorms (weight, eps), then the rotary embedding with ``cos`` and sign-folded
        ``sin`` (dense, one ``hd`` row per leading index of q and k). Each row's heads are
        dense; rows may be strided (q and k as column slices of one q/k/v GEMM's output)."""
        *_, q_heads, hd = q.shape
        *_, k_heads, k_hd = k.shape
        rows = q.numel() // max(q_heads * hd, 1)
        _same(q, k)
        _same(q, cos)
        _same(q, sin)
        q_ld, k_ld = _row_stride(q) or 0, _row_stride(k) or 0
        ok = q_ld >= q_heads * hd and k_ld >= k_heads * hd  # rows never overlap
        ok = ok and cos.is_contiguous() and sin.is_contiguous()
        ok = ok and k_hd == hd and hd % 2 == 0 and hd <= MAX_HEAD_DIM
        ok = ok and k.numel() == rows * k_heads * hd and cos.numel() == sin.numel() == rows * hd
        _check(
            ok, "q [rows, heads, hd], k [rows, kv_heads, hd] (dense heads), cos/sin [rows, hd]", q
        )
        if (q_norm is None) != (k_norm is None):
            raise ValueError("fused kernel: q_norm and k_norm come together")
        q_w, q_eps = q_norm or (None, 0.0)
        k_w, k_eps = k_norm or (None, 0.0)
        if q_w is not None and k_w is not None:
            _same(q, q_w)
            _same(q, k_w)
            ok = q_w.shape == k_w.shape == (hd,) and q_w.is_contiguous() and k_w.is_contiguous()
            _check(ok, "norm weights [hd]", q_w)
        self._rope[q.dtype](
            q.data_ptr(),
            k.data_ptr(),
            _ptr(q_w),
            _ptr(k_w),
            cos.data_ptr(),
            sin.data_ptr(),
            rows,
            q_heads,
            k_heads,
            hd,
            q_ld,
            k_ld,
            q_eps,
            k_eps,
        )

    # ---------------------------------------------------------------- training kernels

    def rms_norm_fwd(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``weight * x_hat`` over the last dim of dense ``x`` (as :meth:`rms_norm`), and each
        row's fp32 rstd ``[rows]`` for :meth:`rms_norm_bwd`."""
        n = _norm_rows(x, weight)
        y, rstd = torch.empty_like(x), torch.empty(x.numel() // n, dtype=torch.float32)
        fn = self._train["rms_norm_fwd", x.dtype]
        fn(
            x.data_ptr(),
            weight.data_ptr(),
            y.data_ptr(),
            rstd.data_ptr(),
            len(rstd),
            n,
            eps,
            _threads(x.numel()),
        )
        return y, rstd

    def rms_norm_bwd(
        self, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients of :meth:`rms_norm_fwd`: ``dx`` (x's dtype) and ``dw`` (fp32)."""
        n = _norm_rows(x, weight)
        rows = x.numel() // n
        _check(grad.shape == x.shape and grad.is_contiguous(), "grad like x", grad)
        _same(x, grad)
        _check(rstd.dtype == torch.float32 and rstd.shape == (rows,), "fp32 rstd [rows]", rstd)
        threads = _threads(x.numel())
        dx = torch.empty_like(x)
        dw = torch.zeros(2, threads, n, dtype=torch.float32)  # per thread: sum, block sum
        fn = self._train["rms_norm_bwd", x.dtype]
        fn(
            grad.data_ptr(),
            x.data_ptr(),
            weight.data_ptr(),
            rstd.data_ptr(),
            dx.data_ptr(),
            dw.data_ptr(),
            rows,
            n,
            threads,
        )
        return dx, dw[0].sum(0)

    def silu_mul_fwd(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``silu(g) * u`` (dense, same shape and dtype), rounded as ``F.silu(g) * u``."""
        _elementwise(g, u)
        out = torch.empty_like(g)
        fn = self._train["silu_mul_fwd", g.dtype]
        fn(g.data_ptr(), u.data_ptr(), out.data_ptr(), g.numel(), _threads(g.numel()))
        return out

    def silu_mul_bwd(
        self, grad: torch.Tensor, g: torch.Tensor, u: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients ``(dg, du)`` of :meth:`silu_mul_fwd` for ``grad``."""
        _elementwise(g, u)
        _elementwise(g, grad)
        dg, du = torch.empty_like(g), torch.empty_like(u)
        fn = self._train["silu_mul_bwd", g.dtype]
        fn(
            grad.data_ptr(),
            g.data_ptr(),
            u.data_ptr(),
            dg.data_ptr(),
            du.data_ptr(),
            g.numel(),
            _threads(g.numel()),
        )
        return dg, du

    def rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False
    ) -> torch.Tensor:
        """``x * cos + x.roll(hd // 2, -1) * sin`` as a new dense tensor, rounded as those ATen
        ops round: ``x [B, T, heads, hd]`` with a dense last dim, ``cos``/``sin`` (sign folded)
        dense ``[B or 1, T, 1, hd]``. ``backward``: the gradient of that map for ``x`` = the
        output's gradient, ``x * cos + (x * sin).roll(hd // 2, -1)``."""
        _same(x, cos)
        _same(x, sin)
        x = x if x.stride(-1) == 1 else x.contiguous()
        batch, seq, heads, hd = x.shape if x.dim() == 4 else (0, 0, 0, 0)
        ok = x.dim() == 4 and hd % 2 == 0
        ok = ok and cos.shape == sin.shape and cos.shape in ((batch, seq, 1, hd), (1, seq, 1, hd))
        _check(ok and cos.is_contiguous() and sin.is_contiguous(), "x [B, T, H, hd], cos", x)
        y = torch.empty(x.shape, dtype=x.dtype)
        sb, st, sh, _ = x.stride()
        shared = cos.shape[0] == 1
        self._train["rope", x.dtype](
            x.data_ptr(),
            y.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            batch,
            seq,
            heads,
            hd,
            sb,
            st,
            sh,
            0 if shared else seq * hd,
            int(backward),
            _threads(x.numel()),
        )
        return y


def _threads(elements: int) -> int:
    """The team for a training kernel: torch's intra-op threads, fewer for a small tensor."""
    return max(1, min(torch.get_num_threads(), elements // _SERIAL_BELOW))


def _norm_rows(x: torch.Tensor, weight: torch.Tensor) -> int:
    n = x.shape[-1]
    _same(x, weight)
    ok = x.is_contiguous() and weight.shape == (n,) and weight.is_contiguous()
    _check(ok and n > 0, "dense x [..., n], w [n]", x)
    return n


def _elementwise(a: torch.Tensor, b: torch.Tensor) -> None:
    _same(a, b)
    _check(a.shape == b.shape and a.is_contiguous() and b.is_contiguous(), "dense, alike", b)


def _row_stride(t: torch.Tensor) -> int | None:
    """The element step between rows of ``t [..., heads, hd]`` whose heads are dense and whose
    leading dims flatten into evenly spaced rows; None otherwise."""
    if t.dim() < 2 or t.stride(-1) != 1 or (t.shape[-2] > 1 and t.stride(-2) != t.shape[-1]):
        return None
    lead = [(n, st) for n, st in zip(t.shape[:-2], t.stride()[:-2], strict=True) if n > 1]
    ld = lead[-1][1] if lead else t.shape[-2] * t.shape[-1]
    step = ld
    for n, st in reversed(lead):  # each leading dim spans the ones after it
        if st != step:
            return None
        step *= n
    return ld


def _check(ok: bool, what: str, t: torch.Tensor) -> None:
    if not ok:
        raise ValueError(
            f"fused kernel: expected {what}, got shape {tuple(t.shape)} strides {t.stride()}"
        )


def _same(x: torch.Tensor, t: torch.Tensor) -> None:
    if t.dtype is not x.dtype or not t.is_cpu or not x.is_cpu or x.dtype not in DTYPES:
        raise ValueError(
            f"fused kernel: expected CPU tensors of one dtype (float32 or bfloat16), got "
            f"{x.dtype} on {x.device} and {t.dtype} on {t.device}"
        )
