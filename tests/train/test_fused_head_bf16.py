"""The fused LM head's gradients in a bf16 model do not lose precision as chunks get smaller.

Each engine runs the same bf16 model (tiny-qwen3) through ``forward_backward`` with a different
``logprob_chunk_size``; the reference is that model cast to fp64 with plain full-logits log-probs.
bf16 matmuls are emulated on CPU (~100x slower), so the batch is a few short datums.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from furlong.train.engine import EngineConfig, TrainingEngine
from furlong.train.logprobs import head_logprobs
from tests.train.helpers import random_datums

CHUNKS = [1, 2, 4, 8]
UNCHUNKED = 0  # logprob_chunk_size <= 0: one chunk, so nothing is summed across chunks
# Targets drawn from two ids: each of those head rows sums ~64 positions' contributions, the sum
# that chunking splits up, so that is where a per-chunk rounding shows.
DATUMS = random_datums([32, 32, 32, 32], seed=1, vocab=5)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


def _reference(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """fp64 lm_head weight gradient and per-datum log-probs of the same (bf16-valued) weights."""
    m = copy.deepcopy(model).double()
    lps = []
    for d in DATUMS:
        logits = m(input_ids=d.model_input.view(1, -1)).logits[0]
        targets = d.loss_fn_inputs["target_tokens"].view(-1, 1)
        lp = torch.log_softmax(logits, -1).gather(-1, targets).squeeze(-1)
        (-(d.loss_fn_inputs["weights"].double() * lp).sum()).backward()
        lps.append(lp.detach())
    return m.get_output_embeddings().weight.grad, lps


@pytest.fixture(scope="module")
def runs() -> dict:
    out: dict = {}
    for chunk in [*CHUNKS, UNCHUNKED]:
        e = TrainingEngine.from_pretrained(
            "tiny-qwen3", EngineConfig(logprob_chunk_size=chunk), seed=0, dtype=torch.bfloat16
        )
        if "ref" not in out:
            out["ref"] = _reference(e.model)
        result = e.forward_backward(DATUMS, "cross_entropy")
        # the bf16 gradient went to the head's fp32 master (one pass: an exact copy of it)
        master_of = dict(zip(map(id, e.masters.model_params), e.params, strict=True))
        grad = master_of[id(e.model.get_output_embeddings().weight)].grad
        assert grad.dtype == torch.float32 and torch.equal(grad, grad.bfloat16().float())
        out[chunk] = (grad, [o["logprobs"] for o in result.outputs])
    return out


def test_bf16_head_weight_grad_error_does_not_grow_with_chunks(runs):
    ref_grad, _ = runs["ref"]
    errors = {c: _rel(runs[c][0], ref_grad) for c in [*CHUNKS, UNCHUNKED]}
    table = ", ".join(f"chunk {c or 'off'}: {e:.2e}" for c, e in errors.items())
    base = errors[UNCHUNKED]
    for c in CHUNKS:
        assert errors[c] <= 1.5 * base + 1e-5, f"chunk {c} error grows vs unchunked ({table})"
    assert max(errors.values()) <= 1.5 * min(errors.values()), f"errors spread ({table})"


def test_bf16_head_logprobs(runs):
    _, ref_lps = runs["ref"]
    for c in [*CHUNKS, UNCHUNKED]:
        for got, ref in zip(runs[c][1], ref_lps, strict=True):
            assert got.dtype == torch.float32
            # bf16 trunk and head against fp64: about 2^-8 relative on logits of O(1)
            diff = float((got.double() - ref).abs().max())
            assert diff < 5e-2, f"chunk {c}: log-prob max |diff| {diff:.2e}"
        # the forward is row-wise: a row's log-prob does not depend on its chunk
        for got, base in zip(runs[c][1], runs[UNCHUNKED][1], strict=True):
            assert torch.equal(got, base), f"chunk {c}: log-probs differ from unchunked"


@pytest.mark.parametrize("chunk", CHUNKS)
def test_bf16_head_bias_grad_in_fp32(chunk):
    # tiny-qwen3's head has no bias: the fused head directly, with one, in bf16
    g = torch.Generator().manual_seed(3)
    head = nn.Linear(16, 40, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(40, 16, generator=g) * 0.3)
        head.bias.copy_(torch.randn(40, generator=g) * 0.5)
    hidden = torch.randn(64, 16, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, 4, (64,), generator=g)  # few targets: long per-row sums
    coeffs = torch.rand(64, generator=g) + 0.5

    w = head.weight.detach().double().requires_grad_(True)
    b = head.bias.detach().double().requires_grad_(True)
    lp_ref = torch.log_softmax(hidden.double() @ w.T + b, -1).gather(-1, targets[:, None])
    (lp_ref.squeeze(-1) * coeffs.double()).sum().backward()

    errors = {}
    for c in (chunk, UNCHUNKED):
        head.zero_grad(set_to_none=True)
        lp, _ = head_logprobs(hidden, head, targets, chunk_size=c)
        (lp * coeffs).sum().backward()
        assert head.weight.grad.dtype == head.bias.grad.dtype == torch.bfloat16
        errors[c] = (_rel(head.weight.grad, w.grad), _rel(head.bias.grad, b.grad))
    for i, name in enumerate(("weight", "bias")):
        got, base = errors[chunk][i], errors[UNCHUNKED][i]
        assert got <= 1.5 * base + 1e-5, f"{name}: chunk {chunk} {got:.2e} vs off {base:.2e}"
