"""Colocated train/rollout hand-off (contract (e)): the event order per mode and phase, host
and device peaks from real tensor sizes, a kv_cache-only level, the ledger's balance over
cycles, the rollout following the trainer, trainer sleep/wake, validation and ledger errors.

Real components: a TrainingEngine and an EmbeddedEngine on separate copies of tiny-qwen3. Fake
components (declared byte sizes, non-zero KV) pin the gpu-mode device peak."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from furlong.errors import InputError
from furlong.models import build_preset
from furlong.rl.handoff import (
    ByteLedger,
    Colocation,
    HandoffConfig,
    LedgerError,
    trainer_bytes,
)
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sampling import SamplingParams
from furlong.train.engine import TrainingEngine
from furlong.types import AdamParams
from tests.train.helpers import random_datums, sequence_datum

pytestmark = pytest.mark.usefixtures("one_thread")

SAMPLING = SamplingParams(max_tokens=6, seed=1, stop_token_ids=())
ADAM = AdamParams(learning_rate=1e-2)
EVENTS = {  # (startup, after_generate, publish), full level, trainer offload
    "cpu": (
        ["offload_all", "load_trainer", "trainer_sleep", "onload_weights"]
        + ["update_weights", "onload_kv"],
        ["offload_kv", "offload_weights", "trainer_wake"],
        ["trainer_sleep", "onload_weights", "update_weights", "onload_kv"],
    ),
    "gpu": (
        ["offload_kv", "load_trainer", "trainer_sleep", "update_weights", "onload_kv"],
        ["offload_kv", "trainer_wake", "offload_weights"],
        ["clear_caches", "onload_weights", "trainer_sleep", "update_weights", "onload_kv"],
    ),
}
CALLS = {  # the rollout engine's offload/onload calls per phase
    "cpu": (
        [("offload", ["kv_cache", "weights"]), ("onload", ["weights"]), ("onload", ["kv_cache"])],
        [("offload", ["kv_cache"]), ("offload", ["weights"])],
        [("onload", ["weights"]), ("onload", ["kv_cache"])],
    ),
    "gpu": (
        [("offload", ["kv_cache"]), ("onload", ["kv_cache"])],
        [("offload", ["kv_cache"]), ("offload", ["weights"])],
        [("onload", ["weights"]), ("onload", ["kv_cache"])],
    ),
}


@pytest.fixture(scope="module")
def base():
    return build_preset("tiny-qwen3", seed=0)


@pytest.fixture()
def pair(base):
    """A trainer and a rollout engine on separate copies, as in a real colocated run; the
    rollout's offload/onload calls are recorded."""
    model, tokenizer = base
    trainer = TrainingEngine(copy.deepcopy(model), tokenizer)
    rollout = EmbeddedEngine(copy.deepcopy(model), tokenizer)
    rollout.calls = []  # type: ignore[attr-defined]
    for name in ("offload", "onload"):
        real = getattr(rollout, name)

        def spy(tags, real=real, name=name):
            rollout.calls.append((name, list(tags)))
            return real(tags)

        setattr(rollout, name, spy)
    return trainer, rollout


def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(t)["input_ids"] for t in ("What is 2 + 3?", "Name a colour.")]


def train_step(trainer: TrainingEngine, results) -> None:
    """Cross-entropy on the sampled responses: a real step that changes the weights."""
    data = [sequence_datum(r.prompt_ids + r.output_ids, len(r.output_ids)) for r in results]
    trainer.forward_backward(data, "cross_entropy")
    trainer.optim_step(ADAM)


def update(trainer: TrainingEngine, rollout: EmbeddedEngine):
    return lambda: rollout.update_weights(trainer.weights())


def cycle(colo: Colocation, trainer, rollout, tokenizer) -> None:
    results = rollout.generate(prompts(tokenizer), SAMPLING)
    colo.after_generate()
    train_step(trainer, results)
    colo.publish(update(trainer, rollout))


def param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def awake_trainer_bytes(model: torch.nn.Module) -> int:
    """Independent: fp32 weights + AdamW's two moments + its fp32 step scalar per parameter
    (every parameter trains)."""
    return sum(3 * p.numel() * 4 + 4 for p in model.parameters())


# ---------------------------------------------------------------- real components


@pytest.mark.parametrize("mode", ["cpu", "gpu"])
def test_event_sequence_and_engine_calls_per_mode_and_phase(pair, base, mode: str) -> None:
    trainer, rollout = pair
    colo = Colocation(trainer, rollout, HandoffConfig(memory_peak_device=mode))
    colo.startup(lambda: None, update(trainer, rollout))
    phases = [(colo.ledger.events[:], rollout.calls[:], trainer.host_weights is not None)]
    for _ in range(2):
        results = rollout.generate(prompts(base[1]), SAMPLING)
        n_events, n_calls = len(colo.ledger.events), len(rollout.calls)
        colo.after_generate()
        asleep = trainer.host_weights is not None
        phases.append((colo.ledger.events[n_events:], rollout.calls[n_calls:], asleep))
        train_step(trainer, results)
        n_events, n_calls = len(colo.ledger.events), len(rollout.calls)
        colo.publish(update(trainer, rollout))
        asleep = trainer.host_weights is not None
        phases.append((colo.ledger.events[n_events:], rollout.calls[n_calls:], asleep))
    startup, after, publish = EVENTS[mode]
    c_startup, c_after, c_publish = CALLS[mode]
    assert phases == [
        (startup, c_startup, True),
        (after, c_after, False),
        (publish, c_publish, True),
        (after, c_after, False),
        (publish, c_publish, True),
    ]


@pytest.mark.parametrize("mode", ["cpu", "gpu"])
def test_host_and_device_peaks_from_real_tensor_sizes(pair, base, mode: str) -> None:
    trainer, rollout = pair
    mirror = param_bytes(rollout.model)  # the rollout's whole model
    colo = Colocation(trainer, rollout, HandoffConfig(memory_peak_device=mode))
    colo.startup(lambda: None, update(trainer, rollout))
    for _ in range(2):
        cycle(colo, trainer, rollout, base[1])
    backup = awake_trainer_bytes(base[0])  # weights + optimizer state, after a step
    assert colo.ledger.regions["backup"] == backup and backup != mirror
    if mode == "cpu":  # mirror and backup coexist; the device holds one side at a time
        assert colo.ledger.peak == {"host": mirror + backup, "device": max(mirror, backup)}
    else:  # they take turns; the device holds engine weights + the awake trainer
        assert colo.ledger.peak == {"host": max(mirror, backup), "device": mirror + backup}
    assert colo.ledger.peaks() == {
        "host_peak_bytes:max": float(colo.ledger.peak["host"]),
        "device_peak_bytes:max": float(colo.ledger.peak["device"]),
    }


def test_kv_cache_only_level_never_moves_the_rollout_weights(pair, base) -> None:
    trainer, rollout = pair
    weights = param_bytes(rollout.model)
    colo = Colocation(trainer, rollout, HandoffConfig(frozenset({"kv_cache"})))
    colo.startup(lambda: None, update(trainer, rollout))
    assert colo.ledger.events == [
        "offload_all",
        "load_trainer",
        "trainer_sleep",
        "update_weights",
        "onload_kv",
    ]
    for _ in range(2):
        results = rollout.generate(prompts(base[1]), SAMPLING)
        n = len(colo.ledger.events)
        colo.after_generate()
        assert colo.ledger.events[n:] == ["offload_kv", "trainer_wake"]
        assert rollout.offloaded == {"kv_cache"}
        assert rollout.memory_bytes()["weights"] == weights  # still resident
        train_step(trainer, results)
        n = len(colo.ledger.events)
        colo.publish(update(trainer, rollout))
        assert colo.ledger.events[n:] == ["trainer_sleep", "update_weights", "onload_kv"]
    assert all("weights" not in tags for _, tags in rollout.calls)
    assert not any(e in colo.ledger.events for e in ("offload_weights", "onload_weights"))
    assert colo.ledger.peak["host"] == awake_trainer_bytes(base[0])  # no mirror, ever


@pytest.mark.parametrize("mode", ["cpu", "gpu"])
def test_ledger_returns_to_baseline_and_rollout_follows_trainer(pair, base, mode: str) -> None:
    trainer, rollout = pair
    model, tokenizer = base
    weights = param_bytes(rollout.model)
    colo = Colocation(trainer, rollout, HandoffConfig(memory_peak_device=mode))
    colo.startup(lambda: None, update(trainer, rollout))
    snapshots = []
    for _ in range(3):
        cycle(colo, trainer, rollout, tokenizer)
        snapshots.append((colo.ledger.snapshot(), colo.ledger.current))
        published = trainer.weights()
        live = dict(rollout.model.named_parameters())
        assert published.keys() == live.keys()
        assert all(torch.equal(live[n].data, t) for n, t in published.items())
    regions = {"weights": weights, "kv_cache": 0, "trainer": 0, "mirror": 0}
    regions["backup"] = awake_trainer_bytes(base[0])
    baseline = ((regions, frozenset({"trainer"})), {"host": regions["backup"], "device": weights})
    assert snapshots == [baseline] * 3  # from the first step on (it creates AdamW's state)
    assert rollout.weight_version == 4  # startup + 3 publications

    # the rollout generates as a fresh engine on the trained weights does
    trained = {n: t.clone() for n, t in trainer.weights().items()}
    assert not all(torch.equal(trained[n], p) for n, p in model.named_parameters())
    fresh_model = copy.deepcopy(model)
    fresh_model.load_state_dict(trained, strict=False)
    fresh = EmbeddedEngine(fresh_model, tokenizer)
    ours, theirs = (e.generate(prompts(tokenizer), SAMPLING) for e in (rollout, fresh))
    for a, b in zip(ours, theirs, strict=True):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(a.output_logprobs, b.output_logprobs, atol=1e-6, rtol=0)


def test_phases_run_in_order_and_publish_refuses_pending_gradients(pair, base) -> None:
    trainer, rollout = pair
    colo = Colocation(trainer, rollout)
    with pytest.raises(InputError, match="after_generate: the hand-off is in phase 'down'"):
        colo.after_generate()
    with pytest.raises(InputError, match="publish: .* follows after_generate"):
        colo.publish(lambda: None)
    colo.startup(lambda: None, update(trainer, rollout))
    with pytest.raises(InputError, match="startup: the hand-off is in phase 'generating'"):
        colo.startup(lambda: None, lambda: None)
    results = rollout.generate(prompts(base[1]), SAMPLING)
    colo.after_generate()
    trainer.forward_backward(random_datums([4]), "cross_entropy")  # no optim_step
    events, snapshot = colo.ledger.events[:], colo.ledger.snapshot()
    with pytest.raises(InputError, match="pending gradients"):
        colo.publish(update(trainer, rollout))
    assert (colo.ledger.events, colo.ledger.snapshot()) == (events, snapshot)  # nothing moved
    assert trainer.host_weights is None and rollout.offloaded == {"kv_cache", "weights"}
    trainer.zero_grad()
    train_step(trainer, results)
    colo.publish(update(trainer, rollout))
    assert colo.phase == "generating"


# ---------------------------------------------------------------- trainer sleep / wake


def optimizer_tensors(trainer: TrainingEngine) -> list[torch.Tensor]:
    return [
        v.clone()
        for p in trainer.params
        for v in trainer.optimizer.state[p].values()
        if isinstance(v, torch.Tensor)
    ]


def test_trainer_sleep_wake_is_bit_exact_and_the_next_step_identical(base) -> None:
    model, tokenizer = base
    slept, control = (TrainingEngine(copy.deepcopy(model), tokenizer) for _ in range(2))
    data = random_datums([5, 7])
    for e in (slept, control):
        e.forward_backward(data, "cross_entropy")
        e.optim_step(ADAM)
    params = [p.detach().clone() for p in slept.params]
    state = optimizer_tensors(slept)

    slept.forward_backward(data, "cross_entropy")
    with pytest.raises(InputError, match="gradients are pending"):
        slept.sleep()
    slept.zero_grad()
    moved = slept.sleep()
    assert moved == awake_trainer_bytes(model) and trainer_bytes(slept) == 0
    assert all(p.numel() == 0 for p in slept.params)  # live storage released
    assert all(
        torch.equal(slept.host_weights[n], p)
        for n, p in zip(slept.param_names, params, strict=True)
    )
    for call in (
        lambda: slept.forward(data, "cross_entropy"),
        lambda: slept.forward_backward(data, "cross_entropy"),
        lambda: slept.optim_step(ADAM),
    ):
        with pytest.raises(InputError, match="asleep"):
            call()
    with pytest.raises(InputError, match="already asleep"):
        slept.sleep()

    assert slept.wake() == moved
    assert slept.host_weights is None and trainer_bytes(slept) == moved
    assert all(torch.equal(a, b) for a, b in zip(slept.params, params, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(optimizer_tensors(slept), state, strict=True))
    with pytest.raises(InputError, match="not asleep"):
        slept.wake()

    for e in (slept, control):
        e.forward_backward(data, "cross_entropy")
        e.optim_step(ADAM)
    assert all(torch.equal(a, b) for a, b in zip(slept.params, control.params, strict=True))
    pairs = zip(optimizer_tensors(slept), optimizer_tensors(control), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_trainer_sleeps_before_its_first_step(base) -> None:
    """No optimizer state yet: only the weights move, and the first step still runs."""
    trainer = TrainingEngine(copy.deepcopy(base[0]), base[1])
    assert trainer.sleep() == param_bytes(base[0])
    trainer.wake()
    trainer.forward_backward(random_datums([4]), "cross_entropy")
    assert trainer.optim_step(ADAM)["step:max"] == 1.0


# ---------------------------------------------------------------- fake components


class FakeRollout:
    """Declared sizes; strict pairing like the real engines; reports its own bytes."""

    def __init__(self, weights: int, kv: int):
        self.sizes, self.offloaded, self.calls = {"weights": weights, "kv_cache": kv}, set(), []

    def offload(self, tags) -> None:
        assert not set(tags) & self.offloaded, f"double offload {tags}"
        self.offloaded |= set(tags)
        self.calls.append(("offload", list(tags)))

    def onload(self, tags) -> None:
        assert set(tags) <= self.offloaded, f"onload of {tags}, not offloaded"
        self.offloaded -= set(tags)
        self.calls.append(("onload", list(tags)))

    def memory_bytes(self) -> dict[str, int]:
        out = {t: 0 if t in self.offloaded else n for t, n in self.sizes.items()}
        return {**out, "mirror": self.sizes["weights"] if "weights" in self.offloaded else 0}


class FakeTrainer:
    """``weights`` bytes of parameters; a train step adds ``state`` bytes of optimizer state."""

    def __init__(self, weights: int, state: int):
        p = torch.nn.Parameter(torch.zeros(weights, dtype=torch.uint8), requires_grad=False)
        self.params, self.optimizer, self.state = [p], SimpleNamespace(state={}), state
        self.backup: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None
        self.cleared = 0

    def train_step(self) -> None:
        self.optimizer.state[self.params[0]] = {"m": torch.zeros(self.state, dtype=torch.uint8)}

    def sleep(self) -> int:
        assert self.backup is None
        p = self.params[0]
        state = self.optimizer.state.get(p, {})
        self.backup = (p.data, dict(state))
        p.data = p.data.new_empty(0)
        state.update({k: v.new_empty(0) for k, v in state.items()})
        return self.backup[0].nbytes + sum(v.nbytes for v in self.backup[1].values())

    def wake(self) -> int:
        assert self.backup is not None
        (data, saved), self.backup = self.backup, None
        self.params[0].data = data
        self.optimizer.state.get(self.params[0], {}).update(saved)
        return data.nbytes + sum(v.nbytes for v in saved.values())

    def clear_caches(self) -> None:
        self.cleared += 1


def fake_run(mode: str, level=frozenset({"kv_cache", "weight"}), offload_trainer=True, steps=2):
    rollout, trainer = FakeRollout(weights=1000, kv=300), FakeTrainer(weights=150, state=250)
    config = HandoffConfig(level, mode, offload_trainer)
    colo = Colocation(trainer, rollout, config)  # type: ignore[arg-type]
    colo.startup(lambda: None, lambda: None)
    for _ in range(steps):
        colo.after_generate()
        trainer.train_step()
        colo.publish(lambda: None)
    return colo, rollout, trainer


def test_gpu_mode_device_peak_is_engine_weights_plus_awake_trainer_with_kv_freed() -> None:
    # weights 1000, kv 300; trainer 150 at init, 400 after its first step (mirror > backup)
    colo, rollout, trainer = fake_run("gpu")
    assert colo.ledger.peak == {"host": max(1000, 400), "device": 1000 + 400}  # not + kv
    assert trainer.cleared == 2 and not rollout.offloaded
    assert colo.ledger.events == EVENTS["gpu"][0] + (EVENTS["gpu"][1] + EVENTS["gpu"][2]) * 2
    assert rollout.calls == CALLS["gpu"][0] + (CALLS["gpu"][1] + CALLS["gpu"][2]) * 2

    colo, rollout, _ = fake_run("cpu")
    assert colo.ledger.peak == {"host": 1000 + 400, "device": max(1000 + 300, 400)}
    assert colo.ledger.events == EVENTS["cpu"][0] + (EVENTS["cpu"][1] + EVENTS["cpu"][2]) * 2


def test_fake_runs_balance_and_skip_what_is_not_offloaded() -> None:
    for mode in ("cpu", "gpu"):
        one, _, _ = fake_run(mode, steps=1)
        three, rollout, _ = fake_run(mode, steps=3)
        assert one.ledger.snapshot() == three.ledger.snapshot()
        assert three.ledger.regions["mirror"] == 0 and not rollout.offloaded
    colo, rollout, _ = fake_run("cpu", level=frozenset({"kv_cache"}), steps=1)
    assert all("weights" not in tags for _, tags in rollout.calls)
    assert colo.ledger.peak == {"host": 400, "device": 1000 + 400}
    colo, rollout, _ = fake_run("cpu", offload_trainer=False, steps=1)
    assert not any(e.startswith("trainer_") for e in colo.ledger.events)
    assert colo.ledger.regions["backup"] == 0 and colo.ledger.regions["trainer"] == 400
    colo, rollout, _ = fake_run("cpu", level=frozenset(), steps=1)
    assert rollout.calls == [] and colo.ledger.peak["host"] == 400


# ---------------------------------------------------------------- validation and ledger


@pytest.mark.parametrize(
    ("config", "has_critic", "match"),
    [
        (HandoffConfig(memory_peak_device="gpu", offload_trainer=False), False, "offload_trainer"),
        (HandoffConfig(frozenset({"kv_cache"}), "gpu"), False, "add 'weight'"),
        (HandoffConfig(frozenset(), "gpu"), False, "add 'weight'"),
        (HandoffConfig(memory_peak_device="gpu"), True, "not wired for the critic path"),
        (HandoffConfig(frozenset({"weights"})), False, r"\['weights'\].*spelled 'weight'"),
        (HandoffConfig(frozenset({"kv", "weight"})), False, r"unknown \['kv'\]"),
        (HandoffConfig(memory_peak_device="tpu"), False, "memory_peak_device: 'tpu'"),
    ],
)
def test_validation_says_what_to_change(config: HandoffConfig, has_critic: bool, match: str):
    with pytest.raises(InputError, match=match):
        config.validate(has_critic)
    rollout = FakeRollout(10, 10)
    with pytest.raises(InputError, match=match):
        Colocation(FakeTrainer(1, 1), rollout, config, has_critic=has_critic)  # type: ignore
    assert rollout.calls == []


def test_valid_configurations() -> None:
    HandoffConfig().validate(has_critic=True)  # cpu serves the critic path
    HandoffConfig(memory_peak_device="gpu").validate()
    HandoffConfig(frozenset({"weight"}), "gpu").validate()
    HandoffConfig(frozenset(), offload_trainer=False).validate()
    assert HandoffConfig("weight").offload_rollout_level == {"weight"}  # type: ignore[arg-type]
    assert HandoffConfig(["kv_cache"]).offload_rollout_level == {"kv_cache"}  # type: ignore


def test_ledger_errors_leave_it_unchanged() -> None:
    ledger = ByteLedger()
    ledger.set("weights", 100)
    ledger.release("weights", 100, to="mirror")
    before = ledger.snapshot()
    with pytest.raises(LedgerError, match="double release of 'weights'"):
        ledger.release("weights", 100, to="mirror")
    with pytest.raises(LedgerError, match="resume of 'trainer', which is not released"):
        ledger.resume("trainer", 10, source="backup")
    with pytest.raises(LedgerError, match="negative balance"):
        ledger.resume("weights", 150, source="mirror")  # more than the mirror holds
    with pytest.raises(LedgerError, match="partial resume"):
        ledger.resume("weights", 60, source="mirror")
    ledger.set("trainer", 40)
    with pytest.raises(LedgerError, match="negative balance"):
        ledger.release("trainer", 50, to="backup")
    with pytest.raises(LedgerError, match="partial release"):
        ledger.release("trainer", 30, to="backup")
    with pytest.raises(LedgerError, match="is released"):
        ledger.set("weights", 5)
    with pytest.raises(LedgerError, match="not one of"):
        ledger.release("mirror", 0)
    assert ledger.snapshot() == ({**before[0], "trainer": 40}, before[1])
    ledger.resume("weights", 100, source="mirror")
    assert ledger.current == {"host": 0, "device": 140}
    assert ledger.peak == {"host": 100, "device": 140}
