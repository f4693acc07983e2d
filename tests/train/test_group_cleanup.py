"""A TrainerGroup that fails to start leaves no `furlong-group-*` directory behind: neither when
a rank cannot be started nor in the commonest failure, a script without a __main__ guard."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from furlong.train import group

ROOT = Path(__file__).resolve().parents[2]


def test_a_rank_that_cannot_start_leaves_no_directory(tmp_path, monkeypatch) -> None:
    spawn = group.mp.get_context("spawn")

    class Refused:
        def __init__(self, **kwargs: object) -> None:
            pass

        def start(self) -> None:
            raise OSError("no processes left")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    context = SimpleNamespace(Pipe=spawn.Pipe, Process=Refused)
    monkeypatch.setattr(group.mp, "get_context", lambda method: context)
    with pytest.raises(OSError, match="no processes left"):
        group.TrainerGroup("tiny-qwen3", ranks=2)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # three interpreters import torch
def test_a_script_without_a_main_guard_fails_and_leaves_no_directory(tmp_path) -> None:
    (tmp_path / "unguarded.py").write_text(
        "from furlong.train.group import TrainerGroup\n\nTrainerGroup('tiny-qwen3', ranks=2)\n"
    )
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = os.environ | {"TMPDIR": str(scratch), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "unguarded.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "died" in done.stderr  # the controller's error; the ranks explain the guard
    assert [p.name for p in scratch.glob("furlong-group-*")] == []
