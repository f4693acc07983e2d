"""The PPO critic trains with the run's engine settings (issue 25): its optimizer kind and
state store, and prefix sharing, are the actor's, not a default EngineConfig's."""

from __future__ import annotations

import pytest
import torch

from furlong.rl.build import build_parts
from furlong.rl.config import load_config
from furlong.rl.scale import ScaleOut
from furlong.train.muon import Muon
from furlong.types import AdamParams, Datum

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_critic_takes_the_runs_optimizer_and_state_store(tmp_path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    config = load_config(
        None,
        [
            "model.name=tiny-qwen3",
            "algo.advantage=gae",
            "algo.objective=ppo",
            "algo.share_prefixes=true",
            "optimizer.kind=muon",
            "optimizer.state_store=disk",
            f'optimizer.disk_dir="{state}"',
            "warmup.steps=0",
            "run.progress=false",
            f"run.out_dir={tmp_path / 'run'}",
        ],
    )
    critic = build_parts(config, ScaleOut(), None).critic
    assert critic is not None and critic.config.share_prefixes
    n = 5
    returns, old = torch.linspace(-1, 1, n), torch.zeros(n)
    tokens = list(range(3, 3 + n + 1))
    datum = Datum.next_token(tokens, returns=returns, old_values=old, weights=torch.ones(n))
    before = {k: v.clone() for k, v in critic.model.state_dict().items()}
    critic.forward_backward([datum], "value", {"value_clip": 0.0})
    critic.optim_step(AdamParams(learning_rate=1e-3))
    optimizer = critic.optimizer
    assert any(isinstance(part, Muon) for part in optimizer.parts)  # not in-memory AdamW
    assert optimizer.store.kind == "disk"
    assert optimizer.store.file_backed_bytes(optimizer.parts) > 0
    moved = [k for k, v in critic.model.state_dict().items() if not torch.equal(v, before[k])]
    assert moved  # the step applied
