from pathlib import Path

import pytest

from furlong.rl import tasks
from tests.train.helpers import short_text


@pytest.fixture
def short_reward(monkeypatch: pytest.MonkeyPatch) -> None:
    """``task.reward=short_text`` names the shared reward stub for this test only."""
    monkeypatch.setitem(tasks.REWARDS, "short_text", short_text)


def one_step_run(out: Path, *extra: str) -> list[str]:
    """Overrides of the smallest whole run: tiny-qwen3, one RL step of 2 x 2 samples of 4
    tokens, 2 greedy held-out problems, no bars, no HF export; ``extra`` on top."""
    return [
        "model.name=tiny-qwen3",
        "task.eval_size=2",
        "task.eval_samples=0",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_tokens=4",
        "run.steps=1",
        "run.export_hf=false",
        "run.progress=false",
        f"run.out_dir={out}",
        *extra,
    ]
