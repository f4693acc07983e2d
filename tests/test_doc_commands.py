"""The shell commands in README.md and the docs stay valid: every `furlong ...` line parses
with the real CLI parser, and every `furlong train` / `furlong demo` line builds a config that
validates (GPU lines are checked on CPU with the device swapped, when there is no GPU). The
recipes' CPU smoke command runs for real."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from furlong import cli
from furlong.demo import demo_config
from furlong.metrics import read_metrics
from furlong.models import names
from furlong.rl.config import load_config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SUBCOMMANDS = {"demo", "train", "init-model", "rollout-server", "session-server", "serve", "env"}


def _commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words and words[-1] == "&":
                    words = words[:-1]
                if len(words) < 2 or not words[0].endswith("furlong"):
                    continue
                if words[1] not in SUBCOMMANDS or any("..." in w or "$" in w for w in words):
                    continue  # prose placeholders, not commands
                found.append((f"{page.relative_to(ROOT)}: {line.strip()}", words[1:]))
    return found


COMMANDS = _commands()


def test_the_docs_have_commands() -> None:
    kinds = {argv[0] for _, argv in COMMANDS}
    assert {"train", "demo", "serve", "session-server"} <= kinds


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_documented_command_is_valid(where: str, argv: list[str], monkeypatch, tmp_path) -> None:
    # a GPU recipe's hub id (Qwen/Qwen3-0.6B): checked as if the hub answered, as offline it
    # is rightly refused unless cached (tests/models/test_names.py)
    monkeypatch.setattr(names, "hub_unreachable", lambda: None)
    args = cli.build_parser().parse_args(argv)
    if args.command not in ("train", "demo"):
        return
    overrides = list(args.overrides)
    if not torch.cuda.is_available():  # a GPU shape: check everything but the device
        overrides = ["model.device=cpu" if o.startswith("model.device=") else o for o in overrides]
    monkeypatch.chdir(tmp_path)  # a task file the page names as the reader's own (math.jsonl)
    for o in overrides:
        if o.startswith("task.path="):
            (tmp_path / o.partition("=")[2]).write_text('{"prompt": "1+1", "answer": "2"}\n')
    if args.command == "demo":
        demo_config(args.algo, args.out, *overrides)
        return
    args.overrides = overrides
    config = args.config if args.config and args.config.endswith(".toml") else None
    # a file the page names as the reader's own (run.toml): check the rest of the line alone
    file = ROOT / config if config and (ROOT / config).exists() else None
    if config and file is None:
        args.config = None
    cli.train_config(args, str(file) if file else None)


def test_the_recipe_cpu_smoke_runs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    out = tmp_path / "smoke"
    argv = [
        "train",
        "docs/recipes/runs/small-qwen3-grpo/config.toml",
        "model.name=tiny-qwen3",
        "warmup.steps=20",
        "run.steps=5",
        "task.eval_size=20",
        "run.progress=false",
        f"run.out_dir={out}",
    ]
    assert any(argv[1] in where and "warmup.steps=20" in where for where, _ in COMMANDS)
    assert cli.main(argv) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))
    assert load_config(out / "config.toml").model.name == "tiny-qwen3"
