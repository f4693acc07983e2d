"""Periodic checkpoints of an RL run, and a bit-identical resume from one.

Layout under the run's ``out_dir``::

    checkpoints/
      latest                the name of the newest complete checkpoint (replaced atomically)
      step-000120/
        actor/              TrainingEngine.save_state: weights + optimizer state
        actor_critic/       the critic's TrainingEngine.save_state (algo.advantage = "gae" only)
        reference/          the frozen reference, when one is kept and a warm-up ran (without
                            a warm-up it is the model as loaded, re-derived on resume)
        base/               a LoRA run's base model after its warm-up (an HF directory; the
                            adapter and its optimizer are in actor/), loaded instead of
                            model.name on resume
        rng.safetensors     torch's CPU (and CUDA) generator states
        state.json          step, rollout weight version, metrics step, the loop's Random
        config.toml         the run's config when saved

A checkpoint is staged in a temp directory (the actor right after its optimizer step, while
it is awake even under colocation) and renamed into place whole only after its step's metrics
line is written: ``latest`` never names a partial checkpoint, and ``metrics.jsonl`` always
reaches the checkpoint's step. Per-step sampling seeds derive from ``run.seed`` and the step,
so with the generator states restored the resumed steps repeat the uninterrupted run's.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from safetensors.torch import load_file, save_file

from furlong.atomic import atomic_write_text
from furlong.errors import InputError
from furlong.models.loading import atomic_dir, publish_dir, recover_published, save_hf_dir
from furlong.rl import critic as critic_mod
from furlong.rl.config import RLConfig, load_config, to_toml
from furlong.rl.scale import ScaleOut
from furlong.train import checkpoint as ckpt
from furlong.train.api import Trainer

M = TypeVar("M", bound=torch.nn.Module)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from furlong.train.engine import TrainingEngine

CHECKPOINTS = "checkpoints"
LATEST = "latest"
ACTOR = "actor"
CRITIC = ACTOR + "_critic"  # the critic's checkpoint: a sibling "<save>_critic" directory
REFERENCE = "reference"
BASE = "base"
STATE = "state.json"
RNG = "rng.safetensors"
ACTOR_INFO = {"role": "actor"}
# what a resume may change: lengths, outputs and where memory lives, never the math (the
# colocated hand-off and the optimizer's state store move exact copies)
FREE_FIELDS = (
    "run.steps",
    "run.eval_every",
    "run.save_every",
    "run.export_hf",
    "run.progress",
    "run.out_dir",
    "optimizer.state_store",
    "optimizer.disk_dir",
    "optimizer.chunk_bytes",
)
FREE_GROUPS = ("colocate",)


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint directory, read back."""

    path: Path
    step: int
    weight_version: int
    python_rng: tuple
    config: RLConfig

    @property
    def run_dir(self) -> Path:
        return self.path.parent.parent


@dataclass(frozen=True)
class Pending:
    """A checkpoint being written: its temp directory and where it goes."""

    tmp: Path
    final: Path


def checkpoint_dir(out: Path, step: int) -> Path:
    return out / CHECKPOINTS / f"step-{step:06d}"


# ---------------------------------------------------------------- saving


def stage(
    out: Path,
    step: int,
    actor: Trainer,
    critic: TrainingEngine | None,
    reference: TrainingEngine | None,
    base: tuple[PreTrainedModel, PreTrainedTokenizerBase] | None = None,
) -> Pending:
    """Write the engines' states into a temp checkpoint directory; ``reference`` is None when
    it need not be saved; ``base``: a LoRA actor's (model, tokenizer) when it was warmed up."""
    tmp, final = atomic_dir(checkpoint_dir(out, step))
    try:
        actor.save_state(tmp / ACTOR, info=ACTOR_INFO)
        if critic is not None:
            critic.save_state(tmp / CRITIC, info=critic_mod.INFO)
        if reference is not None:
            reference.save_state(tmp / REFERENCE)
        if base is not None:
            save_hf_dir(*base, tmp / BASE)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Pending(tmp, final)


def commit(pending: Pending, config: RLConfig, step: int, rng: random.Random) -> Path:
    """Add the step's generator states and config, publish the directory, point ``latest``
    at it."""
    version, state, gauss = rng.getstate()
    meta: dict[str, Any] = {"step": step, "weight_version": step, "metrics_step": step}
    meta["python_rng"] = [version, list(state), gauss]
    try:
        (pending.tmp / STATE).write_text(json.dumps(meta))
        save_file(_torch_rng(config.model.device), str(pending.tmp / RNG))
        (pending.tmp / "config.toml").write_text(to_toml(config))
    except BaseException:
        shutil.rmtree(pending.tmp, ignore_errors=True)
        raise
    publish_dir(pending.tmp, pending.final)
    atomic_write_text(pending.final.parent / LATEST, pending.final.name)
    return pending.final


def forget_latest(out: Path) -> None:
    """A fresh run in an old directory: ``--resume`` must not find the old run's checkpoint."""
    (out / CHECKPOINTS / LATEST).unlink(missing_ok=True)


def _torch_rng(device: str) -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if device.startswith("cuda"):
        states |= {f"cuda:{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return states


# ---------------------------------------------------------------- resuming


def prepare(
    config: RLConfig, scale: ScaleOut, resume: str | os.PathLike | None
) -> Checkpoint | None:
    """Check that this run can save and resume as asked; the checkpoint to resume from."""
    if config.run.save_every and scale.enabled:
        raise InputError(
            "run.save_every: checkpoints are not wired for trainer ranks or Ray (scale.*); "
            "set run.save_every=0 there"
        )
    if resume is None:
        return None
    saved = find_checkpoint(resume)
    check_resumable(saved, config, scale)
    return saved


def find_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """``path``: a checkpoint directory, or a run's ``out_dir`` (its ``latest`` checkpoint)."""
    given = Path(path)
    root = given if given.name == CHECKPOINTS else given / CHECKPOINTS
    if root.is_dir() and not (given / STATE).is_file():
        recover_published(root)  # a crash mid-publish: put the acknowledged copy back
        latest = root / LATEST
        if not latest.is_file():
            raise InputError(f"--resume: {given} has no complete checkpoint ({latest} is missing)")
        given = root / latest.read_text().strip()
    if not (given / STATE).is_file():
        raise InputError(f"--resume: {given} is neither a checkpoint nor a run directory with one")
    meta = json.loads((given / STATE).read_text())
    version, state, gauss = meta["python_rng"]
    return Checkpoint(
        given,
        int(meta["step"]),
        int(meta["weight_version"]),
        (version, tuple(state), gauss),
        load_config(given / "config.toml"),
    )


def check_resumable(saved: Checkpoint, config: RLConfig, scale: ScaleOut) -> None:
    """Refuse a resume that cannot repeat the saved run bit for bit."""
    if scale.enabled:
        raise InputError(
            "--resume: not wired for trainer ranks or Ray (scale.*); resume a one-process run"
        )
    saved_fields, given_fields = _flat(saved.config), _flat(config)
    changed = [
        k
        for k in saved_fields
        if saved_fields[k] != given_fields[k]
        and k not in FREE_FIELDS
        and k.partition(".")[0] not in FREE_GROUPS
    ]
    if changed:
        k = changed[0]
        raise InputError(
            f"{k}: {given_fields[k]!r} differs from the checkpoint's {saved_fields[k]!r} "
            f"({saved.path}); a resume repeats the run bit for bit, so only "
            f"{', '.join(FREE_FIELDS)} and [{'], ['.join(FREE_GROUPS)}] may change"
            + (f" (also changed: {', '.join(changed[1:])})" if changed[1:] else "")
        )
    if config.run.steps < saved.step:
        raise InputError(
            f"run.steps: {config.run.steps} is below the checkpoint's step {saved.step}"
        )


def _flat(config: RLConfig) -> dict[str, Any]:
    return {
        f"{group.name}.{k}": v
        for group in dataclasses.fields(config)
        for k, v in dataclasses.asdict(getattr(config, group.name)).items()
    }


def model_source(saved: Checkpoint | None, name: str) -> str:
    """Where the run's model loads from: a resumed LoRA run's warmed-up base, else ``name``."""
    if saved is not None and (saved.path / BASE).is_dir():
        return str(saved.path / BASE)
    return name


def restore_actor(saved: Checkpoint, actor: Trainer) -> None:
    actor.load_state(saved.path / ACTOR, expect_info=ACTOR_INFO)


def restore_critic(
    saved: Checkpoint,
    critic: TrainingEngine | None,
    from_actor: Callable[[], TrainingEngine | None],
) -> TrainingEngine | None:
    """The critic from its sibling directory; without one, a fresh critic on the actor's
    weights (``from_actor``): the run goes on, but no longer bit-identically."""
    if critic is None:
        return None
    if not (saved.path / CRITIC).is_dir():
        warnings.warn(
            f"{saved.path / CRITIC} is missing: the critic starts again from the actor's "
            "weights (the resumed run is not bit-identical)",
            stacklevel=2,
        )
        return from_actor()
    critic.load_state(saved.path / CRITIC, expect_info=critic_mod.INFO)
    return critic


def actor_model(saved: Checkpoint, like: M) -> M:
    """A copy of ``like`` (awake, the actor's architecture) holding the checkpoint's actor
    weights."""
    tensors, _, meta = ckpt.read_training_state(saved.path / ACTOR)
    if meta["kind"] != ckpt.KIND_MODEL:
        raise InputError(
            f"--resume: {saved.path / CRITIC} is missing and the actor checkpoint holds a LoRA "
            "adapter, not a model to start a fresh critic from"
        )
    model = copy.deepcopy(like)
    with torch.no_grad():
        ckpt.restore_model(model, tensors, meta["aliases"])
    return model


def restore_reference(saved: Checkpoint, reference: TrainingEngine | None) -> None:
    """A saved reference replaces the re-derived one (the model as loaded, before a warm-up)."""
    if reference is not None and (saved.path / REFERENCE).is_dir():
        reference.load_state(saved.path / REFERENCE, optimizer=False)


def restore_rng(saved: Checkpoint, rng: random.Random) -> None:
    """The loop's Random and torch's generators as they were when the checkpoint was taken;
    call it last, once nothing else of the set-up draws from them."""
    rng.setstate(saved.python_rng)
    states = load_file(str(saved.path / RNG))
    torch.set_rng_state(states.pop("cpu"))
    for name, state in states.items():
        torch.cuda.set_rng_state(state, int(name.partition(":")[2]))
