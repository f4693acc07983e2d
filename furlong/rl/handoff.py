"""Colocated train/rollout hand-off: a trainer and a rollout engine share one device and take
turns with it (contract (e) of feature-contracts.md; miles #2781).

:class:`Colocation` runs the three phases in the contract's orders; ``memory_peak_device``
chooses where the peak goes:

- ``cpu`` (default): the rollout's host *mirror* of its weights and the trainer's host *backup*
  coexist (host peak = mirror + backup); the device holds one side at a time.
- ``gpu``: mirror and backup take turns in host memory (host peak = max of the two), paid with
  a device peak of engine weights + awake trainer state (KV freed, caches cleared).

Every memory move is recorded in a :class:`ByteLedger` with bytes measured from real tensors:
on CPU the "device" side is the live tensors and the "host" side the offloaded copies. Offload
and onload always pair: a region outside the level is neither released nor resumed. The
engines have no CUDA-graph tag (``MemoryTag`` is kv_cache | weights), so ``offload_kv``
releases only ``kv_cache``, and is a no-op (no event) when the level lacks it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from furlong.errors import InputError
from furlong.rollout.base import MemoryTag, RolloutEngine
from furlong.train.composite import CompositeOptimizer
from furlong.train.engine import movable_state

LEVELS = ("kv_cache", "weight")
PEAK_DEVICES = ("cpu", "gpu")
_TAGS: dict[str, MemoryTag] = {"kv_cache": "kv_cache", "weight": "weights"}  # level -> tag
HOST_REGIONS = ("mirror", "backup")
DEVICE_REGIONS = ("weights", "kv_cache", "trainer")
Phase = Literal["down", "generating", "training"]


@dataclass(frozen=True)
class HandoffConfig:
    """``offload_rollout_level``: what the rollout releases while the trainer runs (``weight``
    keeps a host mirror). ``memory_peak_device``: ``cpu`` or ``gpu`` (see the module doc).
    ``offload_trainer``: the trainer sleeps (host backup) while the rollout generates."""

    offload_rollout_level: frozenset[str] = frozenset(LEVELS)
    memory_peak_device: str = "cpu"
    offload_trainer: bool = True

    def __post_init__(self) -> None:
        level = self.offload_rollout_level
        level = frozenset([level] if isinstance(level, str) else level)  # not its characters
        object.__setattr__(self, "offload_rollout_level", level)

    def validate(self, has_critic: bool = False) -> None:
        """Raise :class:`InputError` saying what to change.

        ``gpu`` requires colocation on both sides: the trainer sleeps (``offload_trainer``) and
        the rollout releases its weights (``weight`` in the level). Without a mirror there is
        nothing to trade against the backup, and the ``gpu`` order would only add device
        pressure; ``kv_cache`` stays optional (keeping KV resident raises the device peak)."""
        unknown = sorted(self.offload_rollout_level - set(LEVELS))
        if unknown:
            hint = " (spelled 'weight' here)" if "weights" in unknown else ""
            raise InputError(
                f"offload_rollout_level: unknown {unknown}; choose from {list(LEVELS)}{hint}"
            )
        if self.memory_peak_device not in PEAK_DEVICES:
            raise InputError(
                f"memory_peak_device: {self.memory_peak_device!r} is not one of "
                f"{list(PEAK_DEVICES)}"
            )
        if self.memory_peak_device != "gpu":
            return
        if not self.offload_trainer:
            raise InputError(
                "memory_peak_device='gpu' requires trainer offload (colocation): set "
                "offload_trainer=True, or use memory_peak_device='cpu'"
            )
        if "weight" not in self.offload_rollout_level:
            raise InputError(
                "memory_peak_device='gpu' requires rollout weight offload (colocation): add "
                "'weight' to offload_rollout_level, or use memory_peak_device='cpu'"
            )
        if has_critic:
            raise InputError(
                "memory_peak_device='gpu' is not wired for the critic path; use "
                "memory_peak_device='cpu' when training a critic"
            )


class LedgerError(RuntimeError):
    """Memory was moved out of order: a bug in the hand-off, not a bad request."""


class ByteLedger:
    """Bytes per region (device: weights, kv_cache, trainer; host: mirror, backup), current
    and peak bytes per device, and the ordered names of the hand-off events.

    A device region is resident (``set``), then released (its bytes go to a host region or
    are dropped) and resumed (from that host region, which is freed whole). Raises
    :class:`LedgerError` on a double release, a resume of an unreleased region, a negative
    balance and a partial move; a failed call changes nothing."""

    def __init__(self) -> None:
        self.regions: dict[str, int] = dict.fromkeys((*DEVICE_REGIONS, *HOST_REGIONS), 0)
        self.released: set[str] = set()
        self.peak: dict[str, int] = {"host": 0, "device": 0}
        self.events: list[str] = []

    @property
    def current(self) -> dict[str, int]:
        return {
            "host": sum(self.regions[r] for r in HOST_REGIONS),
            "device": sum(self.regions[r] for r in DEVICE_REGIONS),
        }

    def snapshot(self) -> tuple[dict[str, int], frozenset[str]]:
        return dict(self.regions), frozenset(self.released)

    def peaks(self) -> dict[str, float]:
        """Peak bytes per device, as metrics."""
        return {f"{device}_peak_bytes:max": float(b) for device, b in self.peak.items()}

    def record(self, event: str) -> None:
        self.events.append(event)

    def set(self, region: str, nbytes: int) -> None:
        """A resident device region's size (engines up, trainer init, trainer state grown)."""
        _check_region(region, DEVICE_REGIONS)
        if region in self.released:
            raise LedgerError(f"set {region!r}: the region is released")
        self._apply({region: nbytes - self.regions[region]})

    def release(self, region: str, nbytes: int, to: str | None = None) -> None:
        """Release a device region whole; its ``nbytes`` go to host region ``to`` (if any)."""
        _check_region(region, DEVICE_REGIONS)
        if region in self.released:
            raise LedgerError(f"double release of {region!r}")
        new = self._apply({region: -nbytes, **_host(to, nbytes)}, dry=True)
        if new[region] != 0:
            raise LedgerError(f"partial release of {region!r}: {new[region]} bytes left")
        self._apply({region: -nbytes, **_host(to, nbytes)})
        self.released.add(region)

    def resume(self, region: str, nbytes: int, source: str | None = None) -> None:
        """Resume a released device region with ``nbytes``, freeing host region ``source``."""
        _check_region(region, DEVICE_REGIONS)
        if region not in self.released:
            raise LedgerError(f"resume of {region!r}, which is not released")
        new = self._apply({region: nbytes, **_host(source, -nbytes)}, dry=True)
        if source is not None and new[source] != 0:
            raise LedgerError(f"partial resume: {source!r} keeps {new[source]} bytes")
        self._apply({region: nbytes, **_host(source, -nbytes)})
        self.released.discard(region)

    def _apply(self, deltas: Mapping[str, int], dry: bool = False) -> dict[str, int]:
        new = dict(self.regions)
        for region, delta in deltas.items():
            new[region] += int(delta)
        negative = {r: b for r, b in new.items() if b < 0}
        if negative:
            raise LedgerError(f"negative balance: {negative}")
        if not dry:
            self.regions = new
            for device, now in self.current.items():
                self.peak[device] = max(self.peak[device], now)
        return new


def _check_region(region: str, allowed: tuple[str, ...]) -> None:
    if region not in allowed:
        raise LedgerError(f"region {region!r} is not one of {list(allowed)}")


def _host(region: str | None, delta: int) -> dict[str, int]:
    if region is None:
        return {}
    _check_region(region, HOST_REGIONS)
    return {region: delta}


class ColocatedTrainer(Protocol):
    """What the hand-off needs from the trainer (:class:`~furlong.train.engine.TrainingEngine`)."""

    params: list[torch.nn.Parameter]
    optimizer: CompositeOptimizer

    def sleep(self) -> int: ...

    def wake(self) -> int: ...

    def clear_caches(self) -> None: ...


class Colocation:
    """The hand-off between a trainer and a rollout engine on one device.

    Call ``startup`` once, then per step: generate → ``after_generate`` → train →
    ``publish``; ``finish`` once at the end wakes the trainer (to export its weights). Event
    names per phase (full level, trainer offload; a step whose region is outside the level is
    skipped with its twin):

    ======================= ============================================================
    cpu ``startup``         offload_all, load_trainer, trainer_sleep, onload_weights,
                            update_weights, onload_kv
    cpu ``after_generate``  offload_kv, offload_weights, trainer_wake
    cpu ``publish``         trainer_sleep, onload_weights, update_weights, onload_kv
    gpu ``startup``         offload_kv, load_trainer, trainer_sleep, update_weights, onload_kv
    gpu ``after_generate``  offload_kv, trainer_wake, offload_weights
    gpu ``publish``         clear_caches, onload_weights, trainer_sleep, update_weights,
                            onload_kv
    ``finish``              the events of ``after_generate`` (the run is over)
    ======================= ============================================================

    The weight update runs while the trainer sleeps: it reads the trainer's ``weights()`` (the
    host backup then), not ``model.state_dict()`` (emptied). The trainer's device bytes count
    from ``load_trainer`` on (the contract's trainer init) and are re-measured when ``publish``
    starts (the train step grows them: AdamW's moments at the first step). A phase checks its
    order and the trainer's gradients before anything moves; a failure inside ``update`` leaves
    the hand-off mid-phase. ``has_critic`` is for :meth:`HandoffConfig.validate`.
    """

    def __init__(
        self,
        trainer: ColocatedTrainer,
        rollout: RolloutEngine,
        config: HandoffConfig | None = None,
        ledger: ByteLedger | None = None,
        *,
        has_critic: bool = False,
    ):
        self.config = config or HandoffConfig()
        self.config.validate(has_critic)
        self.trainer, self.rollout = trainer, rollout
        self.ledger = ledger if ledger is not None else ByteLedger()
        self.phase: Phase = "down"
        self.gpu = self.config.memory_peak_device == "gpu"
        sizes = rollout.memory_bytes()  # engines up
        self.ledger.set("weights", sizes["weights"])
        self.ledger.set("kv_cache", sizes["kv_cache"])

    def startup(self, load_trainer: Callable[[], object], publish: Callable[[], object]) -> None:
        """Engines up → release → trainer init + checkpoint load (``load_trainer``) → trainer
        sleeps → resume → first weight update (``publish``) → KV back."""
        self._enter("startup", "down")
        if self.gpu:  # weights stay resident: the trainer loads beside them
            self._offload("offload_kv", ["kv_cache"])
        else:  # the generic full release, tightened to the level
            self._offload("offload_all", LEVELS)
        load_trainer()
        self.ledger.record("load_trainer")
        self.ledger.set("trainer", trainer_bytes(self.trainer))
        self._sleep()
        if not self.gpu:
            self._onload("onload_weights", ["weight"])
        publish()
        self.ledger.record("update_weights")
        self._onload("onload_kv", ["kv_cache"])
        self.phase = "generating"

    def after_generate(self) -> None:
        """Hand the device to the trainer once generation is done."""
        self._to_trainer("after_generate")

    def finish(self) -> None:
        """The run is over: hand the device to the trainer for good, so that what reads its
        live weights (``export_hf``, ``save_state``) finds it awake. The moves of
        ``after_generate``."""
        self._to_trainer("finish")

    def _to_trainer(self, method: str) -> None:
        self._enter(method, "generating")
        self._offload("offload_kv", ["kv_cache"])
        if self.gpu:  # the trainer wakes into freed device space, the mirror into freed host
            self._wake()
            self._offload("offload_weights", ["weight"])
        else:  # mirror created while the backup exists
            self._offload("offload_weights", ["weight"])
            self._wake()
        self.phase = "training"

    def publish(self, update: Callable[[], object]) -> None:
        """Hand the device back to the rollout and push the new weights (``update``)."""
        self._enter("publish", "training")
        if any(p.grad is not None for p in self.trainer.params):  # before anything moves
            raise InputError("publish: the trainer has pending gradients; optim_step() first")
        # the train step may have grown the trainer's state (AdamW's moments at the first step)
        self.ledger.set("trainer", trainer_bytes(self.trainer))
        if self.gpu:  # engine weights come back while the trainer is awake: the device peak
            self.trainer.clear_caches()
            self.ledger.record("clear_caches")
            self._onload("onload_weights", ["weight"])
            self._sleep()
        else:  # backup created while the mirror exists
            self._sleep()
            self._onload("onload_weights", ["weight"])
        update()
        self.ledger.record("update_weights")
        self._onload("onload_kv", ["kv_cache"])
        self.phase = "generating"

    # ---------------------------------------------------------------- moves

    def _enter(self, method: str, expected: Phase) -> None:
        if self.phase != expected:
            before = {
                "down": "nothing",
                "generating": "startup/publish",
                "training": "after_generate",
            }
            raise InputError(
                f"{method}: the hand-off is in phase {self.phase!r}; {method} follows "
                f"{before[expected]}"
            )

    def _tags(self, levels: Iterable[str]) -> list[MemoryTag]:
        return [_TAGS[x] for x in LEVELS if x in levels and x in self.config.offload_rollout_level]

    def _offload(self, event: str, levels: Iterable[str]) -> None:
        tags = self._tags(levels)
        if not tags:  # a no-op exactly when its onload twin is
            return
        before = self.rollout.memory_bytes()
        self.rollout.offload(tags)
        after = self.rollout.memory_bytes()
        self.ledger.record(event)
        if "kv_cache" in tags:  # dropped: no host copy once generation is done
            self.ledger.release("kv_cache", before["kv_cache"] - after["kv_cache"])
        if "weights" in tags:
            self.ledger.release("weights", after["mirror"] - before["mirror"], to="mirror")

    def _onload(self, event: str, levels: Iterable[str]) -> None:
        tags = self._tags(levels)
        if not tags:
            return
        before = self.rollout.memory_bytes()
        self.rollout.onload(tags)
        after = self.rollout.memory_bytes()
        self.ledger.record(event)
        if "weights" in tags:
            self.ledger.resume("weights", after["weights"] - before["weights"], source="mirror")
        if "kv_cache" in tags:
            self.ledger.resume("kv_cache", after["kv_cache"] - before["kv_cache"])

    def _sleep(self) -> None:
        if self.config.offload_trainer:
            moved = self.trainer.sleep()
            self.ledger.record("trainer_sleep")
            self.ledger.release("trainer", moved, to="backup")

    def _wake(self) -> None:
        if self.config.offload_trainer:
            moved = self.trainer.wake()
            self.ledger.record("trainer_wake")
            self.ledger.resume("trainer", moved, source="backup")


# ---------------------------------------------------------------- measurements (read-only)


def trainer_bytes(trainer: ColocatedTrainer) -> int:
    """Live bytes of the trainable parameters and their optimizer state (what ``sleep``
    moves); 0 while asleep."""
    total = 0
    for p in trainer.params:
        total += p.data.nbytes
        total += sum(v.nbytes for v in movable_state(trainer.optimizer, p).values())
    return total
