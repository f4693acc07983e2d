"""A user's mistake on the command line: exit 2 and one line naming the field or file, never a
traceback. Each case runs `python -m furlong` as a subprocess, as a user would."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from furlong import cli

ROOT = Path(__file__).resolve().parents[1]

# (argv, what the line must name); files are made in the working directory by _files()
CASES = {
    "missing config file": (["train", "nosuch.toml"], "'nosuch.toml': no such file"),
    "malformed TOML": (["train", "bad.toml"], "'bad.toml': not valid TOML"),
    "override without =": (["train", "run.steps"], "'run.steps' is not group.field=value"),
    "missing task.path": (
        ["train", "task.name=jsonl", "task.path=nosuch.jsonl"],
        "task.path: no such file 'nosuch.jsonl'",
    ),
    "task.path for a built-in task": (
        ["train", "task.path=data.jsonl"],
        "task.path: task.name = 'addition' reads no file",
    ),
    "missing api keys file": (
        ["serve", "--api-keys-file", "nosuch-keys"],
        "--api-keys-file: cannot read 'nosuch-keys' (No such file or directory)",
    ),
    # flags after overrides are read as flags: here a bad value of one, after an override
    "flag after overrides": (
        ["train", "run.steps=1", "--trainer-ranks", "0", "run.seed=1"],
        "scale.trainer_ranks: must be an integer >= 1, got 0",
    ),
    "mistyped serve flag": (
        ["serve", "--prot", "8001"],
        "furlong serve: unrecognized arguments: --prot 8001; did you mean --port?",
    ),
    "mistyped command": (["sevre"], "invalid choice: 'sevre'"),
    "mistyped choice": (
        ["session-server", "--pause-mode", "abrt"],
        "invalid choice: 'abrt' (choose from 'abort', 'in_place', 'retract'); did you mean abort?",
    ),
    "missing required flag": (["init-model", "--preset", "tiny-qwen3"], "--out"),
}


def _files(where: Path) -> None:
    (where / "bad.toml").write_text("[run]\nsteps = \n")
    (where / "data.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')


def _furlong(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "furlong", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard, not a timing claim
    )


@pytest.mark.parametrize("case", CASES)
def test_a_user_error_is_one_line(case: str, tmp_path: Path) -> None:
    argv, names = CASES[case]
    _files(tmp_path)
    result = _furlong(argv, tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"furlong {argv[0]}: ") or lines[0].startswith("furlong: ")
    assert names in lines[0]
    assert result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.toml", "data.jsonl"]  # no writes


def test_flags_may_follow_the_overrides() -> None:
    argv = ["train", "run.toml", "run.steps=2", "--trainer-ranks", "2", "run.seed=1", "--ray"]
    args = cli.parse(argv)
    assert (args.command, args.config, args.trainer_ranks, args.ray) == (
        "train",
        "run.toml",
        2,
        "local",
    )
    assert args.overrides == ["run.steps=2", "run.seed=1"]
    # without trailing flags the plain parse is what runs, and gives the same
    args = cli.parse(["train", "--trainer-ranks", "2", "run.toml", "run.steps=2", "run.seed=1"])
    assert (args.config, args.trainer_ranks, args.overrides) == (
        "run.toml",
        2,
        ["run.steps=2", "run.seed=1"],
    )


def test_version_is_the_installed_one(tmp_path: Path) -> None:
    result = _furlong(["--version"], tmp_path)
    assert result.returncode == 0
    assert result.stdout.strip() == f"furlong {importlib.metadata.version('furlong')}"


@pytest.mark.parametrize("command", ["serve", "rollout-server", "session-server"])
def test_help_shows_defaults(command: str) -> None:
    text = " ".join(cli._commands(cli.build_parser())[command].format_help().split())
    assert "--host HOST" in text and "(default: 127.0.0.1)" in text
    port = {"serve": 8000, "rollout-server": 30000, "session-server": 8100}[command]
    assert f"TCP port (default: {port})" in text
    assert "(default: False)" not in text and "(default: None)" not in text


def test_the_servers_default_to_different_ports() -> None:
    commands = cli._commands(cli.build_parser())
    ports = [commands[c].get_default("port") for c in ("serve", "rollout-server", "session-server")]
    assert len(set(ports)) == 3


def test_serve_help_shows_the_memory_bounds_defaults() -> None:
    from furlong.server.bounds import BOUNDS
    from furlong.server.config import ServiceConfig

    text = " ".join(cli._commands(cli.build_parser())["serve"].format_help().split())
    config = ServiceConfig({}, Path("unused"))
    for name, bound in BOUNDS.items():
        assert getattr(config, name) == bound.default  # the config's default is the flag's
        assert f"(default: {bound.default})" in text


def test_a_config_mistake_is_found_before_torch_loads(tmp_path: Path) -> None:
    """The file, the overrides and the model name are read by torch-free code, so such a
    mistake answers at once (benchmarks/cli_startup.py measures how fast)."""
    _files(tmp_path)
    for argv in (["train", "model.name=tiny-qwen4"], ["train", "bad.toml"], ["train", "run.x"]):
        run = f"from furlong import cli; print(cli.main({argv!r}), 'torch' in sys.modules)"
        code = f"import sys; {run}"
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
        assert done.stdout.split() == ["2", "False"], (argv, done.stdout, done.stderr)


def test_serve_dtype_flag_takes_the_precision_names() -> None:
    from furlong.server.config import ServiceConfig

    serve = cli._commands(cli.build_parser())["serve"]
    assert serve.get_default("dtype") == ServiceConfig({}, Path("unused")).dtype == "float32"
    assert cli.parse(["serve", "--dtype", "auto"]).dtype == "auto"
    with pytest.raises(SystemExit):
        cli.parse(["serve", "--dtype", "half"])
