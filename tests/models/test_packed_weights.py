"""Packed bf16 inference weights: FastForward's prefill and decode through them equal the
separate ``F.linear`` calls bit for bit on a CPU with native bf16, they follow every way a
weight changes (in place, swapped, a rollout weight update), and they are dropped where they
do not apply or when the weights are offloaded."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen2Config

from furlong.models import load_model
from furlong.models import packed_weights as pw
from furlong.models.fast_forward import FastForward
from furlong.precision import fast_bf16
from furlong.rollout import kv_cache
from furlong.rollout.model_runner import ModelRunner
from tests.models.test_fast_forward import GQA, SMALL

pytestmark = pytest.mark.usefixtures("one_thread")

native_bf16 = pytest.mark.skipif(
    not (fast_bf16() and pw.onednn_bf16()),  # can_pack's own conditions
    reason="packing applies on a CPU with native bf16 matmuls (AMX / AVX-512 BF16) in oneDNN",
)


def _passes(fast: FastForward, steps: int = 4, seed: int = 0) -> list[torch.Tensor]:
    """A left-padded prefill and ``steps`` decode steps through ``fast``: the logits."""
    model = fast.model
    gen = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 7, 5]
    rows, width = len(lengths), max(lengths)
    ids = torch.randint(1, model.config.vocab_size, (rows, width), generator=gen)
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    cache = kv_cache.new_cache(model.config)
    out = [fast(ids, mask, pos, cache, logits_to_keep=0)]
    for _ in range(steps):
        mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
        pos = mask.sum(1, keepdim=True) - 1
        ids = torch.randint(1, model.config.vocab_size, (rows, 1), generator=gen)
        out.append(fast(ids, mask, pos, cache))
    return out


def _model(name: str) -> torch.nn.Module:
    if name == "qwen2":  # q/k/v with biases
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(Qwen2Config(**SMALL, **GQA))
    return load_model(name)[0]


@native_bf16
@pytest.mark.parametrize("name", ["tiny-qwen3", "small-llama", "qwen2"])
def test_packed_passes_equal_separate_linears_bit_for_bit(name, monkeypatch) -> None:
    model = _model(name).to(torch.bfloat16)
    fast = FastForward(model)
    assert fast.packed.current(model) is not None  # this model packs here
    with torch.inference_mode():
        packed = _passes(fast)
        monkeypatch.setattr(pw, "can_pack", lambda m: False)
        fast.packed.clear()
        separate = _passes(fast)
    for got, want in zip(packed, separate, strict=True):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, want)


@native_bf16
def test_packed_linear_against_fp64() -> None:
    # one GEMM over [q; k; v] with biases: each column block is F.linear with its own weight,
    # bit for bit, and within bf16's output rounding of the exact product
    torch.manual_seed(0)
    linears = [torch.nn.Linear(48, n).to(torch.bfloat16) for n in (32, 16, 16)]
    x = torch.randn(9, 48).to(torch.bfloat16)
    got = pw.PackedLinear(linears)(x)
    want = torch.cat([F.linear(x, m.weight, m.bias) for m in linears], dim=-1)
    assert torch.equal(got, want)
    exact = torch.cat([x.double() @ m.weight.double().T + m.bias.double() for m in linears], dim=-1)
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-6)


def _packs_fp32(monkeypatch) -> None:
    """Packing forced on for an fp32 model: oneDNN packs fp32 on any x86 CPU, so the rebuild
    rules are tested everywhere (fp32 GEMMs through oneDNN sum in another order than MKL's:
    within 1e-5, not bit for bit)."""
    monkeypatch.setattr(
        pw, "can_pack", lambda m: all(type(x) is torch.nn.Linear for x in pw._sources(m))
    )


def _last(fast: FastForward) -> torch.Tensor:
    with torch.inference_mode():
        return _passes(fast, steps=1)[-1]


@pytest.mark.parametrize("change", ["in_place", "swapped", "runner_update"])
def test_packs_follow_weight_changes(change, monkeypatch) -> None:
    _packs_fp32(monkeypatch)
    model, _ = load_model("tiny-qwen3")
    runner = ModelRunner(model)
    fast = runner.fast
    assert fast is not None
    before = _last(fast)  # packs built from the current weights
    built = fast.packed.packs
    assert built is not None
    weight = model.model.layers[1].mlp.up_proj.weight
    new = weight.detach() * 3 + 0.5
    if change == "in_place":
        with torch.no_grad():
            weight.copy_(new)
    elif change == "swapped":
        weight.data = new.clone()
    else:
        runner.update_weights({"model.layers.1.mlp.up_proj.weight": new})
    after = _last(fast)
    assert fast.packed.packs is not None and fast.packed.packs is not built  # rebuilt
    monkeypatch.setattr(pw, "can_pack", lambda m: False)
    fast.packed.clear()
    want = _last(fast)  # the separate linears, reading the modules' weights
    assert (after - before).abs().max() > 1e-2  # the change reaches the logits
    torch.testing.assert_close(after, want, atol=1e-5, rtol=0)


def test_a_lora_layer_added_later_drops_the_packs(monkeypatch) -> None:
    _packs_fp32(monkeypatch)
    model, _ = load_model("tiny-qwen3")
    fast = FastForward(model)
    before = _last(fast)
    assert fast.packed.packs is not None
    from peft import LoraConfig, get_peft_model

    # random A and B, so the adapter changes the logits (peft's default B is zero)
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    after = _last(fast)  # the same FastForward: its model's q_proj layers are LoRA layers now
    assert fast.packed.packs is None
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, _last(FastForward(model)), atol=0, rtol=0)


def test_unchanged_weights_keep_their_packs(monkeypatch) -> None:
    _packs_fp32(monkeypatch)
    model, _ = load_model("tiny-qwen3")
    fast = FastForward(model)
    first = fast.packed.current(model)
    assert first is not None
    with torch.inference_mode():
        _passes(fast, steps=2)
    assert fast.packed.packs is first


def test_what_does_not_pack(monkeypatch) -> None:
    model, _ = load_model("tiny-qwen3")
    assert not pw.can_pack(model)  # fp32
    bf16 = model.to(torch.bfloat16)
    monkeypatch.setattr(pw, "fast_bf16", lambda: False)
    assert not pw.can_pack(bf16)  # bf16 without a native bf16 matmul
    monkeypatch.setattr(pw, "fast_bf16", lambda: True)
    monkeypatch.setattr(pw, "onednn_bf16", lambda: False)
    assert not pw.can_pack(bf16)  # the CPU has it, oneDNN is capped below it
    monkeypatch.setattr(pw, "onednn_bf16", lambda: True)
    assert pw.can_pack(bf16)
    from peft import LoraConfig, get_peft_model

    layer = bf16.model.layers[0].self_attn  # q alone with a bias: q/k/v cannot share a GEMM
    layer.q_proj.bias = torch.nn.Parameter(
        torch.zeros(layer.q_proj.out_features, dtype=torch.bfloat16)
    )
    assert not pw.can_pack(bf16)
    layer.q_proj.bias = None
    assert pw.can_pack(bf16)
    lora = get_peft_model(bf16, LoraConfig(r=4, target_modules=["q_proj"]))
    assert not pw.can_pack(lora.base_model.model)  # a LoRA layer runs unmerged, as before
    assert FastForward(lora.base_model.model).packed.current(lora.base_model.model) is None


def test_offload_drops_the_packs_and_memory_counts_them(monkeypatch) -> None:
    _packs_fp32(monkeypatch)
    model, _ = load_model("tiny-qwen3")
    runner = ModelRunner(model)
    assert runner.fast is not None
    params = sum(p.nbytes for p in model.parameters())
    assert runner.memory_bytes(None)["weights"] == params
    before = _last(runner.fast)
    packed = runner.fast.packed.nbytes
    linears = pw._sources(model)
    assert packed == sum(
        m.weight.nbytes + (m.bias.nbytes if m.bias is not None else 0) for m in linears
    )
    assert runner.memory_bytes(None)["weights"] == params + packed
    runner.offload({"weights"}, None)
    assert runner.fast.packed.nbytes == 0 and runner.memory_bytes(None)["weights"] == 0
    runner.onload({"weights"}, None)
    assert torch.equal(_last(runner.fast), before)  # packed again from the same weights


def test_onednn_capped_below_bf16_says_so() -> None:
    """ONEDNN_MAX_CPU_ISA=AVX2 (the AVX2 kernel set's emulation) on a CPU whose flags list
    AVX-512 BF16: the packed reorder would raise, so oneDNN's own answer rules packing out."""
    import subprocess
    import sys

    code = "from furlong.models import packed_weights as pw; print(pw.onednn_bf16())"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr
