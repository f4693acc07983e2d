"""FastForward: the lean decoder forward equals the HF forward (logits and KV cache) through a
left-padded prefill and decode steps, refuses models it cannot run exactly, and never keeps
stale copies of the weights."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, Qwen2Config, Qwen3Config

from furlong.models import load_model
from furlong.models.fast_forward import FastForward
from furlong.rollout import kv_cache

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = [9, 5, 12, 1]  # left padding in all rows but one, and a one-token row
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=128)
GQA = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _hf(model, ids, mask, pos, cache, keep: int = 1) -> torch.Tensor:
    return model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        cache=cache,
        use_cache=True,
        logits_to_keep=keep,
    ).logits


def _assert_same_as_hf(model, new_cache=kv_cache.new_cache, steps: int = 6) -> None:
    """Prefill (all positions' logits), then decode steps, each against the HF forward with its
    own cache; finally the two caches."""
    fast = FastForward(model)
    rows, width, vocab = len(LENGTHS), max(LENGTHS), model.config.vocab_size
    ids = torch.randint(1, vocab, (rows, width))
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in LENGTHS])
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    ref_cache, fast_cache = new_cache(model.config), new_cache(model.config)
    want = _hf(model, ids, mask, pos, ref_cache, keep=0)
    got = fast(ids, mask, pos, fast_cache, logits_to_keep=0)
    assert got.shape == want.shape and got.dtype == want.dtype
    real = mask.bool()  # padded positions' logits are unused
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)
    for _ in range(steps):
        mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
        pos = mask.sum(1, keepdim=True) - 1
        ids = torch.randint(1, vocab, (rows, 1))
        want = _hf(model, ids, mask, pos, ref_cache)
        got = fast(ids, mask, pos, fast_cache)
        assert got.shape == want.shape == (rows, 1, vocab)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for ref, ours in zip(ref_cache.layers, fast_cache.layers, strict=True):
        assert ours.keys.shape[2] == width + steps
        torch.testing.assert_close(ours.keys, ref.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(ours.values, ref.values, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["tiny-qwen3", "small-qwen3"])
@pytest.mark.parametrize(
    "new_cache", [kv_cache.new_cache, lambda c: DynamicCache(config=c)], ids=["growing", "dynamic"]
)
def test_equals_hf_prefill_and_decode(name: str, new_cache) -> None:
    model, _ = load_model(name)
    assert FastForward.supports(model)
    with torch.inference_mode():
        _assert_same_as_hf(model, new_cache)


@pytest.mark.parametrize(
    "config",
    [
        # biases everywhere (o_proj and MLP too), tied embeddings, no q/k norm
        LlamaConfig(**SMALL, **GQA, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
        Qwen2Config(**SMALL, **GQA),  # q/k/v biases
        Qwen3Config(**SMALL, num_attention_heads=4, num_key_value_heads=4, head_dim=32),  # no GQA
    ],
    ids=["llama", "qwen2", "qwen3-mha"],
)
def test_other_dense_decoders_under_no_grad(config) -> None:
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():  # biases start at zero and norm weights at one
            if p.dim() == 1:
                p.normal_(1.0, 0.2)
        _assert_same_as_hf(model, steps=3)


def test_refuses_what_it_cannot_run_exactly() -> None:
    moe, _ = load_model("tiny-qwen3-moe")
    assert not FastForward.supports(moe)
    with pytest.raises(ValueError):
        FastForward(moe)
    sliding = dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    scaled = dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    for extra in ({}, sliding, scaled, dict(hidden_act="gelu")):
        config = Qwen3Config(**SMALL, **GQA, **extra)
        assert FastForward.supports(AutoModelForCausalLM.from_config(config)) == (not extra)
    model, _ = load_model("tiny-qwen3")
    model.model.layers[1].mlp.register_forward_hook(lambda *_: None)
    assert not FastForward.supports(model)


def test_reads_weights_at_call_time() -> None:
    model, _ = load_model("tiny-qwen3")
    fast = FastForward(model)
    ids, mask = torch.randint(1, 700, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    pos = mask.cumsum(1) - 1

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        c = kv_cache.new_cache(model.config)
        return fast(ids, mask, pos, c), _hf(model, ids, mask, pos, kv_cache.new_cache(model.config))

    with torch.inference_mode():
        before, _ = both()
        # in place through .data, as EmbeddedEngine.update_weights does (no _version bump)
        for p in model.parameters():
            p.data.copy_(p.data * 1.5)
        after, want = both()
        assert not torch.allclose(after, before)
        torch.testing.assert_close(after, want, atol=1e-5, rtol=0)
        # the tensor behind a parameter swapped, as offload/onload does
        q = model.model.layers[0].self_attn.q_proj
        q.weight.data = torch.randn_like(q.weight)
        swapped, want = both()
        assert not torch.allclose(swapped, after)
        torch.testing.assert_close(swapped, want, atol=1e-5, rtol=0)


def test_runs_a_lora_view_as_peft_does(tmp_path) -> None:
    """A LoRA sampler's model (peft layers over the base's weights, adapter unmerged) runs
    through FastForward with the peft forward's logits and cache; a LoRA with dropout, which
    FastForward does not reproduce, is refused."""
    from furlong.train import lora

    base, _ = load_model("tiny-qwen3")
    spec = lora.LoraSpec(rank=4)
    peft = lora.add_adapter(None, base, "m_a", lora.peft_config(base, spec), seed=0)
    with torch.no_grad():
        for _, p in lora.adapter_params(peft, "m_a"):
            p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(3))
    lora.save_adapter(tmp_path, peft, "m_a")
    view = lora.adapted_view(base, tmp_path)
    assert FastForward.supports(view)
    with torch.inference_mode():
        _assert_same_as_hf(view)
    dropout = lora.peft_config(base, spec)
    dropout.lora_dropout = 0.1
    other = lora.add_adapter(None, base, "m_b", dropout, seed=0).get_base_model()
    assert not FastForward.supports(other)


def test_a_bf16_rollout_cache_holds_fp32_and_attends_in_fp32() -> None:
    """A bf16 CPU model's rollout cache keeps its keys and values in fp32, each exactly the bf16
    value it was computed as, and its decode attention is an fp32 SDPA over them: the attention
    output equals fp32 attention over the bf16 q, k and v to fp32 rounding, where bf16 SDPA is
    off by up to a bf16 step."""
    model, _ = load_model("tiny-qwen3")
    model.to(torch.bfloat16)
    fast, cache = FastForward(model), kv_cache.new_cache(model.config)
    ids = torch.randint(
        1, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0)
    )
    mask, pos = torch.ones_like(ids), torch.arange(7).expand(2, 7)
    seen: list[tuple[torch.Tensor, ...]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        out = sdpa(q, k, v, *args, **kwargs)
        seen.append((q, k, v, out))
        return out

    with torch.no_grad():
        fast(ids, mask, pos, cache)  # prefill
        ids = torch.tensor([[3], [5]])
        mask, pos = torch.ones(2, 8, dtype=torch.long), torch.tensor([[7], [7]])
        torch.nn.functional.scaled_dot_product_attention = spy
        try:
            logits = fast(ids, mask, pos, cache)  # a decode step
        finally:
            torch.nn.functional.scaled_dot_product_attention = sdpa
    assert logits.dtype == torch.bfloat16
    for layer in cache.layers:
        assert layer.keys.dtype == layer.values.dtype == torch.float32
        assert layer.keys.shape[-2] == 8
        assert torch.equal(layer.keys, layer.keys.bfloat16().float())  # upcast, not recomputed
        assert torch.equal(layer.values, layer.values.bfloat16().float())
    assert len(seen) == model.config.num_hidden_layers
    for q, k, v, out in seen:
        assert q.dtype == k.dtype == out.dtype == torch.float32
        assert torch.equal(q, q.bfloat16().float())
        scores = (q.double() @ k.double().transpose(-1, -2)) * fast.scaling
        exact = scores.softmax(-1) @ v.double()
        assert (out.double() - exact).abs().max() < 1e-5
