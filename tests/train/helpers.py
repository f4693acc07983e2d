"""Small builders shared by the tests: engines, datums (random, GRPO-like grouped, or over
given tokens), a reward stub for RL runs, and comparisons of parameter dicts."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from furlong.rl import tasks
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


def grouped_datums(seed: int, pad_id: int | None = None) -> list[Datum]:
    """GRPO-like datums: two prompts (13 and 9 tokens) with 3 and 2 sampled continuations each,
    plus a loner; ``pad_id``: the second continuation of each prompt holds it as a real token."""
    g = torch.Generator().manual_seed(seed)
    datums = []
    for prompt_len, samples in ((13, 3), (9, 2), (6, 1)):
        prompt = torch.randint(3, 700, (prompt_len,), generator=g)
        for s in range(samples):
            response = torch.randint(
                3, 700, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g
            )
            if pad_id is not None and s == 1:
                response[1] = pad_id
            tokens = torch.cat([prompt, response])
            n = len(tokens) - 1
            inputs = {
                "target_tokens": tokens[1:],
                "logprobs": -torch.rand(n, generator=g) * 3 - 5,
                "advantages": torch.randn(n, generator=g),
            }
            datums.append(Datum(tokens[:-1], inputs))
    return datums


def sequence_datum(
    tokens: Sequence[int] | torch.Tensor,
    scored: int | None = None,
    logprobs: Sequence[float] | None = None,
) -> Datum:
    """Teacher forcing over ``tokens`` (e.g. a sampled prompt + response) that scores the last
    ``scored`` targets (all by default): cross-entropy weight 1 there and 0 before, or with
    ``logprobs`` (the sampler's, one per scored target) RL inputs with advantage 1 there."""
    n = len(tokens) - 1 if scored is None else scored
    if logprobs is None:
        return Datum.next_token(tokens, weights=torch.ones(n))
    return Datum.next_token(tokens, logprobs=torch.tensor(logprobs), advantages=torch.ones(n))


def short_text(response: str, problem: tasks.Problem) -> float:
    """A reward stub for RL runs, dense and learnable from scratch: fewer characters is better."""
    return -len(response) / 10


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
