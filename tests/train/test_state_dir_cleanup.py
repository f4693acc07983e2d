"""`optimizer.state_store=disk`: the process's state directory goes when the process exits
cleanly (with `optimizer_state/` if nothing else is in it), never while it is in use: a forked
child's exit leaves its parent's directory alone, and another process's directory is kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """\
import os, sys
import torch
from furlong.train import filemap

mine = filemap.process_dir(sys.argv[1])
alloc = filemap.FileAllocator(mine)
state = alloc.empty((64,), torch.float32).fill_(2.0)
child = os.fork()
if child == 0:
    sys.exit(0)  # a normal interpreter exit: atexit handlers run in the child too
os.waitpid(child, 0)
assert mine.is_dir(), "the child's exit removed its parent's directory"
more = alloc.empty((8,), torch.float32)  # the directory still takes allocations
print(mine, float(state.sum() + more.zero_().sum()))
"""


def run(disk: Path) -> tuple[Path, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(disk)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    mine, total = result.stdout.split()
    return Path(mine), total


def test_the_directory_goes_at_exit_and_not_before(tmp_path) -> None:
    mine, total = run(tmp_path)
    assert total == "128.0"
    assert mine.parent == tmp_path / "optimizer_state"
    assert not mine.exists() and list(tmp_path.iterdir()) == []


def test_another_process_directory_is_kept(tmp_path) -> None:
    other = tmp_path / "optimizer_state" / "rank00000-otherhost-123-4"  # another host's
    other.mkdir(parents=True)
    mine, _ = run(tmp_path)
    assert not mine.exists()
    assert list((tmp_path / "optimizer_state").iterdir()) == [other]
