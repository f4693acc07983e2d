"""Small builders shared by the engine tests."""

from __future__ import annotations

import torch

from furlong.train.engine import EngineConfig, TrainingEngine
from furlong.types import Datum


def engine(preset: str = "tiny-qwen3", **config: object) -> TrainingEngine:
    return TrainingEngine.from_pretrained(preset, EngineConfig(**config), seed=0)


def random_datums(
    lengths: list[int], loss_fn: str = "cross_entropy", seed: int = 0, vocab: int = 700
) -> list[Datum]:
    """Nonzero, non-uniform inputs for every objective."""
    g = torch.Generator().manual_seed(seed)
    datums = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n + 1,), generator=g)
        inputs: dict[str, torch.Tensor] = {"target_tokens": ids[1:]}
        if loss_fn == "cross_entropy":
            inputs["weights"] = torch.rand(n, generator=g) * 2 - 0.5
        else:
            inputs["logprobs"] = -torch.rand(n, generator=g) * 3 - 5
            inputs["advantages"] = torch.randn(n, generator=g)
        datums.append(Datum(ids[:-1], inputs))
    return datums


def grads(e: TrainingEngine) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in zip(e.param_names, e.params, strict=True)
    }


def params(e: TrainingEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in zip(e.param_names, e.params, strict=True)}


def assert_close_dicts(a: dict, b: dict, rel: float = 1e-6) -> None:
    """Per tensor: max |a - b| <= rel * max |a| (fp32 summation order moves the last bits)."""
    assert a.keys() == b.keys()
    for k in a:
        scale = float(a[k].abs().max()) or 1.0
        diff = float((a[k] - b[k]).abs().max())
        assert diff <= rel * scale, f"{k}: max diff {diff:.3g} > {rel} x {scale:.3g}"
