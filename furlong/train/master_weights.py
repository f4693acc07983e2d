"""FP32 master weights for a model held in bf16 (or fp16).

The model's parameters stay in their low precision, so every pass (training and the rollout
engine that shares the model) runs its matmuls there; the optimizer steps an fp32 copy of
each trainable low-precision parameter and writes it back rounded to nearest. Gradients
reach the copy through a post-accumulate-grad hook: each backward's bf16 gradient is added to
the master's fp32 ``.grad`` and the parameter's own is cleared, so gradients accumulated over
microbatches and calls are fp32 sums (the mixed-precision recipe of Micikevicius et al.,
"Mixed Precision Training", and Megatron's ``main_grad``). An fp32 parameter is its own master.

One master per parameter, kept in a registry: a later engine on the same model (the RL
actor after the warm-up's engine) continues from the master it finds, unless the parameter
was overwritten since (the master no longer rounds to it), in which case it starts again from
the parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

LOW_PRECISION = (torch.bfloat16, torch.float16)

_MASTERS = WeakIdKeyDictionary()  # low-precision parameter -> its fp32 master
_HOOKED = WeakIdKeyDictionary()  # parameters whose gradients already flow to their master


def _to_master(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook: move ``param``'s gradient onto its master, in fp32."""
    master = _MASTERS.get(param)
    grad = param.grad
    if master is None or grad is None:
        return
    if master.grad is None:
        master.grad = grad.to(master.dtype)
    else:
        master.grad.add_(grad)
    param.grad = None


def _master(param: torch.nn.Parameter) -> torch.nn.Parameter:
    master = _MASTERS.get(param)
    with torch.no_grad():
        if master is None or master.shape != param.shape or not master.to(param.dtype).equal(param):
            master = torch.nn.Parameter(param.detach().to(torch.float32, copy=True))
            _MASTERS[param] = master
    if param not in _HOOKED:
        param.register_post_accumulate_grad_hook(_to_master)
        _HOOKED[param] = True
    return master


class MasterWeights:
    """The optimizer's view of a model's trainable parameters: ``params[i]`` is the fp32 master
    of ``model_params[i]`` (the parameter itself when it is fp32 already)."""

    def __init__(self, model_params: Sequence[torch.nn.Parameter]):
        self.model_params = list(model_params)
        self.params = [_master(p) if p.dtype in LOW_PRECISION else p for p in self.model_params]
        both = zip(self.params, self.model_params, strict=True)
        self.pairs = [(m, p) for m, p in both if m is not p]

    @property
    def any(self) -> bool:
        """Whether any parameter has a separate master."""
        return bool(self.pairs)

    def publish(self) -> None:
        """Write every master into its model parameter (round to nearest)."""
        with torch.no_grad():
            for master, param in self.pairs:
                param.copy_(master)

    def load(self, names: Sequence[str], tensors: Mapping[str, torch.Tensor]) -> None:
        """Set the masters named ``names`` (the engine's order) from ``tensors``, then the
        model parameters from them."""
        with torch.no_grad():
            for name, master, param in zip(names, self.params, self.model_params, strict=True):
                if master is not param and name in tensors:
                    master.copy_(tensors[name])
        self.publish()

    def by_name(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The separate masters by name (what a checkpoint stores instead of the rounded
        parameters)."""
        named = zip(names, self.params, self.model_params, strict=True)
        return {n: m.detach() for n, m, p in named if m is not p}
