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
    """Whether ``model``'s linears pack: on a CPU with native bf16 matmuls and oneDNN, every
    layer's q/k/v/o/gate/up/down and the head a plain bf16 ``nn.Linear``, the linears that
    share a GEMM all with a bias or all without."""
    head = model._modules["lm_head"]  # first, in two lookups: it rules out fp32 and LoRA heads
    if type(head) is not nn.Linear or head.weight.dtype != torch.bfloat16:
        return False
    if not fast_bf16() or not onednn_bf16():
        return False
    linears = _sources(model)
    if not all(type(m) is nn.Linear for m in linears):
        return False
    if any(m.weight.dtype != torch.bfloat16 or not m.weight.is_cpu for m in linears):
        return False
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
            if len({m.bias is None for m in group}) > 1:
                return False
    return True


def onednn_bf16() -> bool:
    """oneDNN's own answer (it honours ``ONEDNN_MAX_CPU_ISA``, which /proc/cpuinfo cannot): a
    CPU whose flags say AVX-512 BF16 may still have oneDNN capped below it, and the reorder
    would then raise. torch's inductor asks the same op."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _sources(model: Any) -> list[nn.Module]:
    """The linears that pack, in order (through ``_modules``: this runs at every pass, and
    ``nn.Module.__getattr__`` would cost ~1 ms a pass on a 30-layer model)."""
    out = []
    for layer in model._modules["model"]._modules["layers"]:
        attn, mlp = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
        out += [attn["q_proj"], attn["k_proj"], attn["v_proj"], attn["o_proj"]]
        out += [mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"]]
    return out + [model._modules["lm_head"]]


def _tensors(linears: Sequence[nn.Module]) -> list[torch.Tensor]:
    params = [m._parameters for m in linears]
    return [t for p in params for t in (p["weight"], p.get("bias")) if t is not None]


class PackedLinear:
    """``F.linear(x, cat(weights), cat(biases))`` with the weight reordered once."""

    def __init__(self, linears: Sequence[nn.Linear]):
        weight = torch.cat([m.weight.detach() for m in linears])
        biases = [m.bias for m in linears]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
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
        self._linears: list[nn.Module] = []  # the modules packed
        # their tensors as packed (detached views: the same storage and version counter);
        # held, so a freed weight's address cannot come back as a new weight's and look the same
        self._sources: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def current(self, model: Any) -> Packs | None:
        """The packs of ``model``'s current weights; None where they do not pack."""
        if self.packs is not None and self._unchanged(_sources(model)):
            return self.packs
        self.clear()
        if not can_pack(model):  # what runs at every pass of a model that does not pack
            return None
        linears = _sources(model)
        layers = [PackedLayer(layer) for layer in model.model.layers]
        self.packs = Packs(layers, PackedLinear([model.lm_head]))
        self._linears = linears
        self._sources = [(t, t.detach(), t._version) for t in _tensors(linears)]
        return self.packs

    def _unchanged(self, linears: list[nn.Module]) -> bool:
        """The same modules with the same tensors, none written since they were packed."""
        if len(linears) != len(self._linears) or any(
            a is not b for a, b in zip(linears, self._linears, strict=True)
        ):
            return False
        tensors = _tensors(linears)
        return len(tensors) == len(self._sources) and all(
            t is p and t.data_ptr() == view.data_ptr() and t._version == version
            for t, (p, view, version) in zip(tensors, self._sources, strict=True)
        )

    def clear(self) -> None:
        """Drop the packs (a weights offload frees their memory too)."""
        self.packs, self._linears, self._sources = None, [], []

    @property
    def nbytes(self) -> int:
        if self.packs is None:
            return 0
        linears = [self.packs.head, *(p for layer in self.packs.layers for p in layer.linears)]
        return sum(p.nbytes for p in linears)
