"""bf16 inference weights packed once for oneDNN, for the rollout's CPU prefill and decode.

A bf16 ``F.linear`` on CPU reorders its weight into oneDNN's blocked layout at every call; at
decode sizes (128 rows x hidden 256) that reorder is 10-25% of the GEMM, and q/k/v and
gate/up as separate GEMMs pay the per-call cost three and two times. :class:`PackedWeights`
keeps each layer's q/k/v as one packed weight, gate/up as one, o, down and the head packed
alone: the same GEMMs, bit for bit the outputs of the separate ``F.linear`` calls on a CPU with
native bf16 (checked on AMX and AVX-512 BF16), for a second copy of those weights. The packs
are rebuilt when any source weight is replaced or changed in place (its data pointer or
version counter moves: an optimizer step, a weight sync), so a sampler always sees the
current weights. Only plain ``nn.Linear`` layers pack (a LoRA layer runs unmerged as before),
and only in bf16: an fp32 ``F.linear`` runs MKL's GEMM, which has no per-call reorder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from furlong.precision import fast_bf16

# oneDNN picks its blocking for a row count; any count runs, this one is the decode batch's
ROWS_HINT = 128


def can_pack(model: Any) -> bool:
    """Whether ``model``'s linears pack: bf16 on a CPU with native bf16 matmuls and oneDNN,
    every layer's q/k/v/o/gate/up/down and the head plain ``nn.Linear``."""
    weight = model.lm_head.weight
    if weight.dtype != torch.bfloat16 or not weight.is_cpu or not fast_bf16():
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return all(type(m) is nn.Linear for m in _sources(model))


def _sources(model: Any) -> list[nn.Linear]:
    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        out += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return out + [model.lm_head]


class PackedLinear:
    """``F.linear(x, cat(weights), cat(biases))`` with the weight reordered once."""

    def __init__(self, linears: Sequence[nn.Linear]):
        weight = torch.cat([m.weight.detach() for m in linears])
        biases = [m.bias for m in linears]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.out_features = weight.shape[0]
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.nbytes)


class PackedLayer:
    def __init__(self, layer: Any):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = PackedLinear([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = PackedLinear([attn.o_proj])
        self.gate_up = PackedLinear([mlp.gate_proj, mlp.up_proj])
        self.down = PackedLinear([mlp.down_proj])
        self.linears = (self.qkv, self.o, self.gate_up, self.down)


class Packs(NamedTuple):
    layers: list[PackedLayer]
    head: PackedLinear


class PackedWeights:
    """A model's packed layers and head, rebuilt when a source weight changes."""

    def __init__(self) -> None:
        self.packs: Packs | None = None  # the last built
        # the sources as packed (detached views: the same storage and version counter); held,
        # so a freed weight's address cannot come back as a new weight's and look unchanged
        self._sources: list[tuple[torch.Tensor, int]] = []

    def current(self, model: Any) -> Packs | None:
        """The packs of ``model``'s current weights; None where they do not pack."""
        if not can_pack(model):
            self.clear()
            return None
        tensors = [t for m in _sources(model) for t in (m.weight, m.bias) if t is not None]
        if (
            self.packs is None
            or len(tensors) != len(self._sources)
            or any(
                t.data_ptr() != s.data_ptr() or t._version != version
                for t, (s, version) in zip(tensors, self._sources, strict=True)
            )
        ):
            self.clear()
            layers = [PackedLayer(layer) for layer in model.model.layers]
            self.packs = Packs(layers, PackedLinear([model.lm_head]))
            self._sources = [(t.detach(), t._version) for t in tensors]
        return self.packs

    def clear(self) -> None:
        """Drop the packs (a weights offload frees their memory too)."""
        self.packs, self._sources = None, []

    @property
    def nbytes(self) -> int:
        if self.packs is None:
            return 0
        linears = [self.packs.head, *(p for layer in self.packs.layers for p in layer.linears)]
        return sum(p.nbytes for p in linears)
