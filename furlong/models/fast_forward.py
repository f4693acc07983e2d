"""A lean forward pass for dense Llama-style decoders (Qwen3, Qwen2, Llama): rollout and training.

On CPU with small models one HF forward step costs mostly fixed Python overhead: module
``__call__`` machinery, output-capturing decorators, ``create_causal_mask``, the rotary table,
RMSNorm as five ops. :class:`FastForward` runs the same ops in the same order straight from the
model's parameters with ``torch.nn.functional``.

Two modes. Inference (``__call__``, under ``no_grad``, the rollout engine's prefill and decode
steps): in-place residual adds, and on CPU in fp32/bf16 the fused kernels of
:mod:`furlong.models.fused_kernels` (each residual add with the RMSNorm after it; Qwen3's q/k norms
with the rotary embedding), which round where HF's modules round but sum in another order: logits
within float tolerance of the HF forward's (1e-5 on the tiny models in fp32), not bit for bit;
without the kernels, ATen's ops as below. A bf16/fp16 CPU model's cache holds fp32 keys and values
(the low-precision values upcast exactly) and attends in fp32. Training and scoring (:meth:`hidden`,
with or without grad): every op out of place under grad; on CPU in fp32/bf16 each RMSNorm, the
rotary embedding (bit for bit) and the MLP's ``silu(g) * u`` run as fused kernels with their own
backward (:mod:`furlong.models.fused_training`: one pass over memory each way where ATen takes 2-8;
HF's roundings, another summation order, so within float tolerance of HF's pass: 1.6e-6 of the
largest hidden value on SmolLM2's 30 layers in fp32). Without the kernels, ATen's ops in HF's order
(bit for bit on CPU in fp32 and bf16 when tested; SDPA kernels may differ elsewhere), RMSNorm as one
autograd node (:class:`_RMSNorm`) whose backward takes four passes over the activations where
autograd's chain over HF's five forward ops takes about twice as many; its forward is HF's, op for
op.

Limits: no dropout; only the exact module classes in ``_ARCH``, with SiLU, default RoPE and full
attention on every layer (:meth:`supports` says no otherwise, e.g. MoE, sliding windows, scaled
RoPE, hooked modules, attention dropout); vanilla peft LoRA layers run unmerged, as peft runs them
(``runs_as_linear``; a training pass over a frozen base in the adapter's dtype uses the merged
weight, :mod:`furlong.models.lora_training`, else folds the adapter's scale and add into one
``addmm``). A training pass over right-padded rows uses SDPA's own causal mask. Weights are read
from the modules at every call, so in-place updates and ``p.data`` swaps are seen; hooks registered
after construction are not run (ask :meth:`supports` again when modules may have changed). One
exception: a bf16 model on a CPU with native bf16 runs inference over packed copies of its linears
(:mod:`furlong.models.packed_weights`: q/k/v and gate/up as one GEMM each, bit for bit), rebuilt
when a weight's data pointer or version counter moves; an in-place write through ``p.data`` bypasses
the counter, so write through ``p.detach()`` or under ``no_grad`` instead."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from torch import nn
from transformers import Cache
from transformers.models.llama import modeling_llama as llama
from transformers.models.qwen2 import modeling_qwen2 as qwen2
from transformers.models.qwen3 import modeling_qwen3 as qwen3

from furlong.models import fused_training, lora_training
from furlong.models.fused_kernels import MAX_HEAD_DIM, FusedKernels, fused_kernels
from furlong.models.packed_weights import PackedWeights, Packs

# causal LM class -> the (decoder layer, attention, MLP, RMSNorm) classes it must be built from
_ARCH: dict[type, tuple[type, ...]] = {
    getattr(m, f"{p}ForCausalLM"): tuple(
        getattr(m, f"{p}{part}") for part in ("DecoderLayer", "Attention", "MLP", "RMSNorm")
    )
    for m, p in ((qwen3, "Qwen3"), (qwen2, "Qwen2"), (llama, "Llama"))
}


# The HF modules are read by attribute name (weight, variance_epsilon, lora_A, ...), which torch
# types as Tensor | Module: they are Any here, checked by ``supports``.
HFModule = Any


def _rms(x: torch.Tensor, norm: HFModule, kernels: FusedKernels | None = None) -> torch.Tensor:
    if kernels is not None:
        return fused_training.rms_norm(x.contiguous(), norm.weight, norm.variance_epsilon, kernels)
    if torch.is_grad_enabled() and (x.requires_grad or norm.weight.requires_grad):
        return _RMSNorm.apply(x, norm.weight, norm.variance_epsilon)
    return torch.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


class _RMSNorm(torch.autograd.Function):
    """HF's RMSNorm (fp32 statistics, ``weight * x_hat`` in the input dtype) with a fused
    backward: ``dx = rstd * (g w - x_hat * mean(g w x_hat))``, ``dw = sum(g x_hat)``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        x_hat = xf * rstd
        ctx.save_for_backward(x_hat, rstd, weight)
        ctx.dtypes = x.dtype, weight.dtype
        return weight * x_hat.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x_hat, rstd, weight = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g = grad.float()
        gw = g * weight.float()
        dot = torch.linalg.vecdot(gw, x_hat).unsqueeze(-1).div_(x_hat.shape[-1])
        dx = gw.sub_(x_hat * dot).mul_(rstd)
        dw = (g * x_hat).reshape(-1, x_hat.shape[-1]).sum(0)
        return dx.to(x_dtype), dw.to(w_dtype), None


def _linear(x: torch.Tensor, m: HFModule) -> torch.Tensor:
    if type(m) is nn.Linear:
        return F.linear(x, m.weight, m.bias)
    # a vanilla peft LoRA layer (``runs_as_linear`` checked it): peft's ``base + B(A(x)) * scaling``
    # with the adapter in its own dtype (peft keeps a bf16 base's adapters in fp32: the input is
    # cast up, the sum is in fp32, and the result goes back to the base's dtype)
    base, terms = m.base_layer, lora_terms(m)
    if (
        torch.is_grad_enabled()
        and len(terms) == 1
        and lora_training.applies(_rows(x), base.weight, base.bias, *terms[0][:2])
    ):  # training one adapter over a frozen base: one GEMM each way (lora_training)
        return lora_training.merged_lora_linear(x, base.weight, base.bias, *terms[0])
    out = F.linear(x, base.weight, base.bias)
    dtype = out.dtype
    for lora_a, lora_b, scaling in terms:
        xa = F.linear(x.to(lora_a.dtype), lora_a)
        if torch.is_grad_enabled():  # training: the scale and the add ride on B's GEMM,
            # in place (no copy of the base's output): no backward reads a linear's output
            flat = out.flatten(0, -2).to(lora_b.dtype)
            out = flat.addmm_(xa.flatten(0, -2), lora_b.t(), alpha=scaling).view(out.shape)
        else:  # inference keeps peft's rounding, op for op (samplers equal peft's forward)
            out = out + F.linear(xa, lora_b) * scaling
    return out.to(dtype)


def _rows(x: torch.Tensor) -> int:
    """How many rows ``x [..., features]`` has."""
    return x.numel() // max(x.shape[-1], 1)


def _attention_dtype(h: torch.Tensor, cached: bool) -> torch.dtype:
    """The dtype attention runs in. A bf16/fp16 model on CPU attends in fp32 in a training pass
    (torch's CPU flash-attention backward is ~5x slower in bf16: 436 vs 88 ms on small-qwen3,
    128 x 70 tokens, AMX CPU) and over a rollout cache, which then holds fp32 keys and values
    (its SDPA decodes ~1.4x slower in bf16: 990 vs 706 us, 128 rows x 100 positions). q, k and
    v are upcast exactly, so fp32 only adds accuracy; scoring without grad or cache keeps HF's
    bf16 op."""
    low = h.dtype in (torch.bfloat16, torch.float16)
    if low and h.is_cpu and (cached or torch.is_grad_enabled()):
        return torch.float32
    return h.dtype


def lora_terms(m: HFModule) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """A peft LoRA layer's active adapters as (A weight, B weight, scaling), in peft's order."""
    return [
        (m.lora_A[a].weight, m.lora_B[a].weight, m.scaling[a])
        for a in m.active_adapters
        if a in m.lora_A
    ]


def runs_as_linear(m: nn.Module) -> bool:
    """An ``nn.Linear``, or a peft LoRA layer over one whose forward ``_linear`` reproduces
    (unmerged, no dropout, bias or variant such as DoRA, A and B in one dtype): a LoRA
    sampler shares its base's weights and applies the adapter at every step."""
    if type(m) is nn.Linear:
        return True
    if type(m) is not LoraLinear or type(m.base_layer) is not nn.Linear:
        return False
    if m.merged or m.disable_adapters or m.fan_in_fan_out:
        return False
    return all(
        a not in m.lora_variant
        and type(m.lora_dropout[a]) is nn.Identity
        and m.lora_A[a].bias is None
        and m.lora_B[a].bias is None
        and m.lora_A[a].weight.dtype == m.lora_B[a].weight.dtype
        for a in m.active_adapters
        if a in m.lora_A
    )


def _right_padded(attention_mask: torch.Tensor) -> bool:
    """Every row's real positions come first (no 0 before a 1)."""
    return bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: FusedKernels | None = None
) -> torch.Tensor:
    # HF's x * cos + rotate_half(x) * sin, with rotate_half's sign folded into ``sin``; not
    # addcmul, whose single rounding differs from HF's in bf16 (the training kernel rounds as
    # these ops do, bit for bit)
    if kernels is not None:
        return fused_training.rope(x, cos, sin, kernels)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def _add(h: torch.Tensor, x: torch.Tensor, in_place: bool) -> torch.Tensor:
    return h.add_(x) if in_place else h + x


def _gated(
    x: torch.Tensor, mlp: HFModule, in_place: bool, train: FusedKernels | None
) -> torch.Tensor:
    """The MLP's ``silu(gate(x)) * up(x)``, HF's op order."""
    if train is not None:
        return fused_training.silu_mul(_linear(x, mlp.gate_proj), _linear(x, mlp.up_proj), train)
    a = F.silu(_linear(x, mlp.gate_proj), inplace=in_place)
    return a.mul_(_linear(x, mlp.up_proj)) if in_place else a * _linear(x, mlp.up_proj)


def _residual_norm(
    h: torch.Tensor,
    delta: torch.Tensor | None,
    norm: HFModule,
    fused: FusedKernels | None,
    in_place: bool,
    train: FusedKernels | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream ``h + delta`` (``h`` when ``delta`` is None) and its RMSNorm."""
    if fused is not None:  # inference: h += delta in the norm's pass
        return h, fused.rms_norm(h, norm.weight, norm.variance_epsilon, residual=delta)
    if delta is not None:
        h = _add(h, delta, in_place)
    return h, _rms(h, norm, train)


class FastForward:
    """``model(...).logits`` of a dense Qwen3/Qwen2/Llama causal LM, with less per-step overhead.

    Call as ``ff(input_ids, attention_mask, position_ids, cache, logits_to_keep)``: the
    arguments the engine gives the HF forward (``attention_mask`` over past + new positions,
    left- or right-padded). Returns logits ``[B, logits_to_keep or T, V]`` in the model dtype.
    :meth:`hidden` is the differentiable decoder output for training passes."""

    def __init__(self, model: nn.Module):
        if not self.supports(model):
            raise ValueError(f"FastForward does not support {type(model).__name__}")
        hf: HFModule = model
        self.model: HFModule = hf
        cfg = hf.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = hf.model.layers[0].self_attn.head_dim
        self.scaling = hf.model.layers[0].self_attn.scaling
        # HF's rotary angles are positions * cat(inv_freq, inv_freq); rotate_half's sign is
        # folded into sin. A buffer, not a weight (scaled/dynamic RoPE is refused).
        inv_freq = hf.model.rotary_emb.inv_freq.float()
        self._inv_freq = torch.cat((inv_freq, inv_freq))
        self._sign = torch.cat((-torch.ones_like(inv_freq), torch.ones_like(inv_freq)))
        norm_cls = _ARCH[type(hf)][3]
        self._norms: list[HFModule] = [m for m in hf.model.modules() if type(m) is norm_cls]
        # the bf16 inference weights packed for oneDNN (empty until a CPU bf16 pass runs)
        self.packed = PackedWeights()

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """True when every module is one this pass reproduces exactly (otherwise keep using
        the HF forward)."""
        arch = _ARCH.get(type(model))
        if arch is None:
            return False
        layer_cls, attn_cls, mlp_cls, norm_cls = arch
        hf: HFModule = model
        cfg, body = hf.config, hf.model
        rope = getattr(cfg, "rope_parameters", None) or {}
        if (
            cfg.hidden_act != "silu"
            or rope.get("rope_type", "default") != "default"
            or getattr(body.rotary_emb, "attention_scaling", 1.0) != 1.0
            or 2 * body.rotary_emb.inv_freq.numel() != body.layers[0].self_attn.head_dim
            or any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ())
            or not getattr(cfg, "is_causal", True)
            or len(body.layers) != cfg.num_hidden_layers
            or getattr(cfg, "attention_dropout", 0.0)
            or type(body.embed_tokens) is not nn.Embedding
            or body.embed_tokens.max_norm is not None
            or body.embed_tokens.scale_grad_by_freq
            or body.embed_tokens.sparse
            or not runs_as_linear(hf.lm_head)
            or type(body.norm) is not norm_cls
        ):
            return False
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
            linears += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            norms += [getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
            if (
                type(layer) is not layer_cls
                or type(attn) is not attn_cls
                or type(mlp) is not mlp_cls
                or not all(runs_as_linear(m) for m in linears)
                or any(type(m) is not norm_cls for m in norms)
                or getattr(attn, "sliding_window", None) is not None
            ):
                return False
        # Hooks (e.g. accelerate offloading) would be skipped.
        return not any(
            m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules()
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Cache,
        logits_to_keep: int = 1,
    ) -> torch.Tensor:
        if torch.is_grad_enabled():  # inference only: the residual adds below are in place
            with torch.no_grad():
                return self(input_ids, attention_mask, position_ids, cache, logits_to_keep)
        fused = self._fused()
        packed = self.packed.current(self.model) if fused is not None else None
        h = self._layers(input_ids, attention_mask, position_ids, cache, fused, None, packed)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        norm = self.model.model.norm
        if fused is not None:
            x = fused.rms_norm(h, norm.weight, norm.variance_epsilon)
        else:
            x = _rms(h, norm)
        return _linear(x, self.model.lm_head) if packed is None else packed.head(x)

    def hidden(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        """The decoder's output ``[B, T, H]`` (after the final norm), what the HF decoder's
        ``last_hidden_state`` holds; differentiable when grad is enabled. Without ``cache`` the
        keys and values are used as computed (a training pass keeps no cache)."""
        # the same ops with or without grad, so a forward-only pass equals forward_backward's
        train = self._fused()
        h = self._layers(input_ids, attention_mask, position_ids, cache, None, train)
        return _rms(h, self.model.model.norm, train)

    def _fused(self) -> FusedKernels | None:
        """The fused CPU kernels when they apply: a CPU model in fp32 or bf16 whose norms are
        in the model's dtype (HF's norm result follows its weight's)."""
        weight = self.model.model.embed_tokens.weight
        applies = weight.is_cpu and FusedKernels.takes(weight.dtype)
        applies = applies and self.head_dim <= MAX_HEAD_DIM
        if not applies or any(m.weight.dtype != weight.dtype for m in self._norms):
            return None
        return fused_kernels()

    def _layers(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Cache | None,
        fused: FusedKernels | None,
        train: FusedKernels | None,
        packed: Packs | None = None,
    ) -> torch.Tensor:
        """The residual stream after the last layer; ``fused``: the inference kernels (in
        place), ``train``: the training ones (out of place, with autograd nodes); ``packed``:
        the packed inference weights, in place of the modules' linears."""
        body = self.model.model
        batch, new = input_ids.shape
        heads, kv_heads, head_dim, scale = self.heads, self.kv_heads, self.head_dim, self.scaling
        embed = body.embed_tokens
        h = F.embedding(input_ids, embed.weight, embed.padding_idx).view(batch * new, -1)
        cos, sin = self._rotary(position_ids, h.dtype)
        decode = new == 1
        in_place = not torch.is_grad_enabled()  # autograd needs every input it saved intact
        attn_dtype = _attention_dtype(h, cache is not None)
        pad = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, past + new]
        if decode:  # additive: SDPA converts a boolean mask again in every layer
            mask = torch.zeros(pad.shape, dtype=attn_dtype, device=h.device)
            mask.masked_fill_(~pad, torch.finfo(attn_dtype).min)
        elif cache is None and _right_padded(attention_mask):
            # a training pass over right-padded rows: plain causal attention is exact for every
            # real token (padding only follows it), and lets SDPA skip the blocks above the
            # diagonal instead of reading a mask
            mask = None
        else:  # causal within the new positions, after all past ones
            total = attention_mask.shape[1]
            q_pos = torch.arange(total - new, total, device=h.device)
            mask = pad & (q_pos[:, None] >= torch.arange(total, device=h.device))
        delta = None  # the last layer's MLP output, not yet added to h
        qkv_widths = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        for i, layer in enumerate(body.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h, x = _residual_norm(h, delta, layer.input_layernorm, fused, in_place, train)
            if packed is not None:  # one GEMM; q, k and v are column slices of its output
                q, k, v = packed.layers[i].qkv(x).split(qkv_widths, dim=-1)
            else:
                q, k, v = _linear(x, attn.q_proj), _linear(x, attn.k_proj), _linear(x, attn.v_proj)
            q = q.view(batch, new, heads, head_dim)
            k = k.view(batch, new, kv_heads, head_dim)
            v = v.view(batch, new, kv_heads, head_dim)
            qk_norm = hasattr(attn, "q_norm")  # Qwen3: per-head RMSNorm before rotary
            if fused is not None:
                norms = (attn.q_norm, attn.k_norm) if qk_norm else ()
                fused.qk_rope(q, k, cos, sin, *[(n.weight, n.variance_epsilon) for n in norms])
            else:
                if qk_norm:
                    q, k = _rms(q, attn.q_norm, train), _rms(k, attn.k_norm, train)
                q, k = _rotate(q, cos, sin, train), _rotate(k, cos, sin, train)
            k, v = k.transpose(1, 2).to(attn_dtype), v.transpose(1, 2).to(attn_dtype)
            q = q.to(attn_dtype)
            if cache is not None:
                k, v = cache.update(k, v, i)
            if decode:
                # One query: its heads sharing a KV head become that head's query rows (what
                # HF's pack_gqa does), so keys and values are never repeated.
                q = q.view(batch, kv_heads, heads // kv_heads, head_dim)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
                o = o.reshape(batch, heads * head_dim)
            else:
                gqa = heads != kv_heads
                q = q.transpose(1, 2)
                o = F.scaled_dot_product_attention(
                    q, k, v, mask, scale=scale, enable_gqa=gqa, is_causal=mask is None
                )
                o = o.transpose(1, 2).reshape(batch * new, heads * head_dim)
            o = o.to(h.dtype)
            delta = packed.layers[i].o(o) if packed is not None else _linear(o, attn.o_proj)
            h, x = _residual_norm(h, delta, layer.post_attention_layernorm, fused, in_place, train)
            if packed is not None:  # gate and up from one GEMM
                g, u = packed.layers[i].gate_up(x).chunk(2, dim=-1)
                delta = packed.layers[i].down(F.silu(g).mul_(u))
            else:
                delta = _linear(_gated(x, mlp, in_place, train), mlp.down_proj)
        h = h if delta is None else _add(h, delta, in_place)
        return h.view(batch, new, -1)

    def _rotary(
        self, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin ``[B, T, 1, head_dim]``, computed as HF does."""
        if self._inv_freq.device != position_ids.device:
            self._inv_freq = self._inv_freq.to(position_ids.device)
            self._sign = self._sign.to(position_ids.device)
        angles = position_ids[..., None, None].float() * self._inv_freq
        return angles.cos().to(dtype), angles.sin().mul_(self._sign).to(dtype)
