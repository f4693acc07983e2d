"""The tool-agent example runs: a warm-up, then RL steps through the session server with a
black-box HTTP agent, multi-turn tool trajectories, and replayed routes."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tool_agent" / "train.py"


def test_tool_agent_example_trains_through_the_session_server(capsys) -> None:
    spec = importlib.util.spec_from_file_location("tool_agent_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = "--steps 2 --prompts-per-step 2 --group-size 2 --warmup-steps 120 --warmup-batch 4"
    history = module.main(args.split())
    assert len(history) == 2
    assert any(m["multi_turn"] > 0 for m in history)  # the agent called the calculator
    for m in history:
        assert m["logprob_diff_max"] < 1e-4  # the trainer replayed the rollout's routes
        assert math.isfinite(m["loss"]) and 0.0 <= m["reward"] <= 1.1
    assert "step 2:" in capsys.readouterr().out
