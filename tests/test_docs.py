"""The Python examples of README.md and docs/*.md run as a user would paste them: each block
is written to a file and run by this interpreter in a fresh process, from an empty directory,
so the docs cannot rot. The blocks that use the tinker SDK get a real server on 127.0.0.1, as
`furlong serve` would give them. A block fails on a nonzero exit, and on a Python warning on
stderr that its user did not cause (a deprecated SDK call, a library's FutureWarning)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from furlong.server.app import create_app
from furlong.server.service import Service, ServiceConfig
from furlong.serving import background_server

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCKS = [
    (f"{page.relative_to(ROOT)}[python block {i}]", block)
    for page in PAGES
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))
]
# what warnings.showwarning prints: "file:line: SomeWarning: message"
WARNING_LINE = re.compile(r"^.*:\d+: \w*Warning: .*$", re.M)
# Warnings a snippet cannot avoid, each allowed only in the blocks that use its source, with
# the reason; the pages say so next to those blocks.
ALLOWED_WARNINGS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # peft 0.21.2's PeftModel.__init__ reads transformers 5's deprecated is_gradient_checkpointing
    # (peft/peft_model.py): every PeftModel built prints it
    (
        "PeftModel",
        re.compile(r"modeling_utils\.py:\d+: FutureWarning: `is_gradient_checkpointing` is"),
    ),
    # tinker-cookbook 0.5.8's weights.download calls ServiceClient.create_rest_client() and uses a
    # client-creation future as the client, both deprecated in tinker 0.38 (constraints.txt pins
    # both)
    ("tinker_cookbook", re.compile(r"tinker_cookbook/weights/_download\.py:\d+: FutureWarning: ")),
)
# a user's shell sets none of these; the suite's own settings must not hide what they would see
NOT_INHERITED = ("PYTHONWARNINGS", "TOKENIZERS_PARALLELISM", "TINKER_BASE_URL", "TINKER_API_KEY")


def run_as_pasted(block: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``block`` saved as ``cwd/snippet.py`` and run with this interpreter, from ``cwd``."""
    (cwd / "snippet.py").write_text(block)
    base = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    # faulthandler: a crash (the SDK's rare SIGABRT at exit) prints every thread's stack
    env = base | {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"} | env
    return subprocess.run(
        [sys.executable, "snippet.py"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def unexpected_warnings(stderr: str, block: str = "") -> list[str]:
    allowed = [pattern for needle, pattern in ALLOWED_WARNINGS if needle in block]
    return [w for w in WARNING_LINE.findall(stderr) if not any(p.search(w) for p in allowed)]


def shows_its_run(stdout: str) -> str:
    """The README's SDK example: the warm-up's loss halves (30 steps on one fixed batch; it
    reaches its floor, ln 10, by step 10 under every kernel set and thread count measured), and
    each of the 20 RL steps prints a reward in [0, 1], then the final checkpoint's path; what
    went wrong, or "". That RL lifts the reward is a claim about learning, not one for a single
    unseeded run: such a claim must hold across seeds and kernel sets (the robustness tier,
    tests/rl/test_demo_robustness.py)."""
    losses = [float(x) for x in re.findall(r"^warm-up \d+: loss ([\d.]+)", stdout, re.M)]
    rewards = [float(x) for x in re.findall(r"^RL \d+: reward ([\d.]+)", stdout, re.M)]
    if len(losses) != 4 or len(rewards) != 20:
        return f"not the 4 warm-up and 20 RL lines:\n{stdout}"
    if losses[-1] > losses[0] / 2:
        return f"the warm-up's loss did not fall: {losses}"
    if not all(0 <= r <= 1 for r in rewards):
        return f"a reward outside [0, 1]: {rewards}"
    if not re.search(r"^tinker://\S+/weights/final$", stdout, re.M):
        return f"no final checkpoint path:\n{stdout}"
    return ""


def checks_for(name: str, block: str) -> list[Callable[[str], str]]:
    """What a block's output must show beyond a clean exit (each returns what is wrong)."""
    return [shows_its_run] if name.startswith("README") and "ServiceClient" in block else []


def test_docs_have_examples() -> None:
    assert any(name.startswith("README") for name, _ in BLOCKS)
    assert any(name.startswith("docs") for name, _ in BLOCKS)
    assert sum(bool(checks_for(name, block)) for name, block in BLOCKS) == 1


def test_warnings_are_recognised() -> None:
    stderr = "/x/snippet.py:11: FutureWarning: deprecated\n  sampler.sample(...)\nprinted\n"
    assert unexpected_warnings(stderr) == ["/x/snippet.py:11: FutureWarning: deprecated"]
    assert unexpected_warnings("loss 0.5\nWarning: a sentence, not a warning\n") == []
    cookbook = "/x/tinker_cookbook/weights/_download.py:89: FutureWarning: DEPRECATED: ..."
    assert unexpected_warnings(cookbook, "from tinker_cookbook import weights") == []
    assert unexpected_warnings(cookbook, "import tinker") == [cookbook]  # only where it is used


def test_the_run_check_reads_the_printed_numbers() -> None:
    warm = "".join(
        f"warm-up {i}: loss {x} per answer\n"
        for i, x in ((0, 6.64), (10, 2.31), (20, 2.3), (29, 2.3))
    )
    flat = "".join(f"RL {i}: reward 0.09  answers 3\n" for i in range(20))
    path = "tinker://m-1/weights/final\n"
    assert shows_its_run(warm + flat + path) == ""  # a flat reward is not this check's business
    assert "did not fall" in shows_its_run(warm.replace("2.3 ", "6.6 ") + flat + path)
    assert "outside [0, 1]" in shows_its_run(warm + flat.replace("0.09", "1.50", 1) + path)
    assert "20 RL lines" in shows_its_run(warm + flat[: flat.index("RL 19")] + path)
    assert "checkpoint path" in shows_its_run(warm + flat)


def run_block(block: str, tmp_path: Path, attempt: int) -> subprocess.CompletedProcess:
    work = tmp_path / f"work{attempt}"  # examples may write run directories
    work.mkdir()
    if not re.search(r"^import tinker$", block, re.M):
        return run_as_pasted(block, work, {})
    # what the docs' bash block starts: furlong serve with a familiar name mapped, its URL and a
    # key in the environment (--jwt-auth for the whoami example, which needs it)
    config = ServiceConfig(
        {"Qwen/Qwen3-8B-Base": "tiny-qwen3"},
        tmp_path / f"state{attempt}",
        jwt_auth="whoami" in block,
    )
    with background_server(create_app(Service(config))) as url:
        return run_as_pasted(block, work, {"TINKER_BASE_URL": url, "TINKER_API_KEY": "tml-local"})


@pytest.mark.parametrize("name,block", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_docs_example_runs(name: str, block: str, tmp_path: Path) -> None:
    for attempt in range(3):
        done = run_block(block, tmp_path, attempt)
        # SIGABRT in interpreter finalisation after complete output, with no Python frame on
        # the stack (faulthandler): seen in ~1 of 28 runs of an SDK + tinker_cookbook snippet,
        # not in furlong's code; rerun up to twice
        if done.returncode != -6:
            break
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stderr}"
    warned = unexpected_warnings(done.stderr, block)
    assert not warned, f"{name} printed warnings its user did not cause:\n{done.stderr}"
    wrong = [what for check in checks_for(name, block) if (what := check(done.stdout))]
    assert not wrong, f"{name}: {wrong}"
