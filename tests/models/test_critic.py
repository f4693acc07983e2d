"""ValueModel: shapes and dtype, seeded head init, HF trunk load with the head hidden from the
loader (and restored when the load raises), tied embeddings, copies that share no storage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from furlong.errors import InputError
from furlong.models import build_preset, loading, save_hf_dir
from furlong.models import critic as critic_module
from furlong.models.critic import (
    ValueModel,
    critic_from_policy,
    critic_from_pretrained,
    hidden_head,
    init_value_head,
    load_hf_trunk,
)

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = torch.tensor([[5, 17, 300, 42, 9], [7, 8, 600, 3, 0]])
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])


@pytest.fixture(scope="module")
def policy():
    return build_preset("tiny-qwen3", seed=0)


@pytest.fixture(scope="module")
def hf_dir(policy, tmp_path_factory) -> Path:
    return save_hf_dir(*policy, tmp_path_factory.mktemp("hf") / "tiny")


def storages(module: torch.nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in module.state_dict().values()}


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


class LoaderSpy:
    """Stands in for ``AutoModel``: records the names the loader was asked to fill."""

    def __init__(self, monkeypatch, critic: ValueModel | None = None):
        self.names: list[str] = []
        self.infos: list[dict] = []
        self.head_hidden: list[bool] = []
        real = critic_module.AutoModel.from_pretrained

        def from_pretrained(*args, **kwargs):
            if critic is not None:
                self.head_hidden.append("value_head" not in critic._modules)
            model, info = real(*args, **kwargs)
            self.names += [n for n, _ in model.named_parameters()]
            self.infos.append(info)
            return model, info

        monkeypatch.setattr(critic_module, "AutoModel", type("Spy", (), {}))
        critic_module.AutoModel.from_pretrained = staticmethod(from_pretrained)


def test_values_shape_dtype_and_independent_oracle(policy) -> None:
    critic = critic_from_policy(policy[0], seed=0)
    with torch.no_grad():
        values = critic(IDS, MASK)
        hidden = policy[0].model(input_ids=IDS, attention_mask=MASK).last_hidden_state
    assert values.shape == (2, 5) and values.dtype == torch.float32
    head = init_value_head(64, seed=0)
    expected = hidden @ head.weight[0] + head.bias[0]
    torch.testing.assert_close(values, expected, atol=1e-6, rtol=0)
    assert values.abs().min() > 0  # a real, nonzero signal, not a zero head
    # Right padding does not move the real positions of a causal trunk.
    with torch.no_grad():
        alone = critic(IDS[1:, :3])
    torch.testing.assert_close(values[1, :3], alone[0], atol=1e-6, rtol=0)


def test_low_precision_trunk_still_returns_fp32() -> None:
    critic = critic_from_pretrained("tiny-qwen3", seed=0, dtype=torch.bfloat16)
    assert critic.value_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert critic(IDS[:1, :3]).dtype == torch.float32


def test_head_init_seeded_and_leaves_global_rng_alone() -> None:
    rng = torch.get_rng_state()
    a, b, other = (init_value_head(4096, seed=s) for s in (3, 3, 4))
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(a.weight, b.weight) and not torch.equal(a.weight, other.weight)
    assert a.weight.shape == (1, 4096) and a.bias.shape == (1,)
    assert torch.equal(a.bias, torch.zeros(1))
    # std of 4096 draws: standard error 0.02 / sqrt(8192) ~ 2.2e-4
    w = a.weight.detach()
    assert abs(float(w.std()) - 0.02) < 1e-3 and abs(float(w.mean())) < 1e-3
    oracle = torch.randn(1, 4096, generator=torch.Generator().manual_seed(3)) * 0.02
    torch.testing.assert_close(a.weight, oracle, atol=1e-8, rtol=1e-6)


def test_critic_head_is_its_seeded_init(policy) -> None:
    for seed in (0, 1):
        head = critic_from_policy(policy[0], seed=seed).value_head
        fresh = init_value_head(64, seed=seed)
        assert torch.equal(head.weight, fresh.weight) and torch.equal(head.bias, fresh.bias)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_from_hf_dir_loads_trunk_alone(preset: str, tmp_path: Path, monkeypatch) -> None:
    policy = build_preset(preset, seed=3)
    hf_dir = save_hf_dir(*policy, tmp_path / preset)
    spy = LoaderSpy(monkeypatch)
    critic = critic_from_pretrained(hf_dir, seed=5)
    source = {
        k[len("model.") :]: v for k, v in policy[0].state_dict().items() if k != "lm_head.weight"
    }
    assert_same_tensors(critic.trunk.state_dict(), source)
    fresh = init_value_head(64, seed=5)
    assert torch.equal(critic.value_head.weight, fresh.weight)
    assert torch.equal(critic.value_head.bias, fresh.bias)
    assert spy.names and not any("value_head" in n or "lm_head" in n for n in spy.names)
    assert spy.infos[0]["missing_keys"] == set()  # the head is not even expected
    assert set(dict(critic.named_parameters())) == {f"trunk.{k}" for k in source} | {
        "value_head.weight",
        "value_head.bias",
    }


def test_preset_critic_equals_policy_trunk(policy) -> None:
    critic = critic_from_pretrained("tiny-qwen3", seed=0)
    assert_same_tensors(critic.trunk.state_dict(), policy[0].model.state_dict())


def test_load_hf_trunk_hides_head_and_keeps_it(policy, hf_dir: Path, monkeypatch) -> None:
    critic = critic_from_pretrained("tiny-qwen3", seed=1)  # other trunk weights, head seed 1
    head_before = {k: v.clone() for k, v in critic.value_head.state_dict().items()}
    head_module = critic.value_head
    loaded: list[list[str]] = []
    real_load = torch.nn.Module.load_state_dict

    def load_spy(self, state_dict, *args, **kwargs):
        loaded.append(list(state_dict))
        return real_load(self, state_dict, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "load_state_dict", load_spy)
    spy = LoaderSpy(monkeypatch, critic)
    load_hf_trunk(critic, hf_dir)
    assert spy.head_hidden == [True]  # detached while the loader ran
    assert loaded and not any("value_head" in k or "lm_head" in k for ks in loaded for k in ks)
    assert critic.value_head is head_module
    assert_same_tensors(critic.value_head.state_dict(), head_before)
    assert_same_tensors(critic.trunk.state_dict(), policy[0].model.state_dict())


def test_head_restored_when_load_raises(policy, tmp_path: Path) -> None:
    critic = critic_from_pretrained("tiny-qwen3", seed=2)
    head = critic.value_head
    before = {k: v.clone() for k, v in critic.state_dict().items()}
    with torch.no_grad():
        values = critic(IDS, MASK)

    corrupt = save_hf_dir(*policy, tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InputError, match="cannot load the trunk"):
        load_hf_trunk(critic, corrupt)
    qwen3(hidden=32, layers=2).save_pretrained(tmp_path / "narrower")  # same names, shapes differ
    with pytest.raises(InputError, match="has shape"):  # all checked before the first copy
        load_hf_trunk(critic, tmp_path / "narrower")
    qwen3(hidden=64, layers=1).save_pretrained(tmp_path / "shallower")
    with pytest.raises(InputError, match="missing"):
        load_hf_trunk(critic, tmp_path / "shallower")
    with pytest.raises(RuntimeError, match="inside"), hidden_head(critic):
        raise RuntimeError("inside")

    assert critic.value_head is head
    assert_same_tensors(critic.state_dict(), before)
    with torch.no_grad():
        assert torch.equal(critic(IDS, MASK), values)


def test_bad_spec_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="neither a model name nor"):
        critic_from_pretrained(tmp_path / "nothing-here")


def test_a_pretrained_model_name_resolves_to_its_cached_dir(
    policy, hf_dir: Path, monkeypatch
) -> None:
    """``smollm2-135m`` goes through ``loading.resolve``; the cache is stubbed with the tiny
    model's directory, so no build (and no real cache) is needed."""
    asked: list[str] = []

    def cached(name: str) -> Path:
        asked.append(name)
        return hf_dir

    monkeypatch.setattr(loading, "pretrained_dir", cached)
    critic = critic_from_pretrained("smollm2-135m")
    assert asked == ["smollm2-135m"]
    assert_same_tensors(critic.trunk.state_dict(), policy[0].model.state_dict())
    other = critic_from_policy(build_preset("tiny-qwen3", seed=1)[0])
    load_hf_trunk(other, "smollm2-135m")
    assert_same_tensors(other.trunk.state_dict(), policy[0].model.state_dict())


def qwen3(hidden: int, layers: int, tied: bool = False, vocab: int = 768) -> torch.nn.Module:
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=tied,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def tied_policy() -> torch.nn.Module:
    model = qwen3(hidden=32, layers=1, tied=True, vocab=128)
    embed = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()  # precondition
    return model


def test_tied_embeddings_are_untied_for_the_critic(tmp_path: Path) -> None:
    model = tied_policy()
    model.save_pretrained(tmp_path / "tied")
    for critic in (critic_from_policy(model, seed=0), critic_from_pretrained(tmp_path / "tied")):
        embed = critic.trunk.get_input_embeddings().weight
        assert torch.equal(embed, model.get_input_embeddings().weight)
        head_ptrs = {p.untyped_storage().data_ptr() for p in critic.value_head.parameters()}
        assert not head_ptrs & storages(critic.trunk)
        assert embed.untyped_storage().data_ptr() not in head_ptrs
        assert not storages(critic) & storages(model)  # nothing shared with the policy


def test_from_policy_shares_no_storage_and_trains_alone(policy) -> None:
    model = policy[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    critic = critic_from_policy(model, seed=0)
    assert not storages(critic) & storages(model)
    critic(IDS, MASK).sum().backward()
    with torch.no_grad():
        for p in critic.parameters():
            p.add_(p.grad)
    assert_same_tensors(model.state_dict(), before)
    assert all(p.grad is None for p in model.parameters())


def test_model_without_separable_trunk_is_refused(monkeypatch) -> None:
    model = tied_policy()
    monkeypatch.setattr(model, "get_decoder", lambda: model)  # the head sits inside the "trunk"
    with pytest.raises(InputError, match="no trunk separable from its LM head"):
        critic_from_policy(model)


def test_hf_dir_load_is_quiet_about_the_lm_head_and_strict_about_other_keys(
    policy, hf_dir: Path, tmp_path: Path, capfd
) -> None:
    from safetensors.torch import load_file, save_file

    critic_from_pretrained(hf_dir, seed=1)
    assert "LOAD REPORT" not in capfd.readouterr().err  # lm_head is left out on purpose
    stray = save_hf_dir(*policy, tmp_path / "stray")
    (shard,) = stray.glob("*.safetensors")
    tensors = load_file(shard)
    tensors["model.extra_probe.weight"] = torch.ones(3)  # not a trunk weight, not the LM head
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(
        InputError, match=r"weights the trunk does not use: \['model.extra_probe.weight'\]"
    ):
        critic_from_pretrained(stray)
