"""A user's mistake on the command line: exit 2 and one line naming the field or file, never a
traceback. Each case runs `python -m furlong` as a subprocess, as a user would."""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from furlong import cli
from furlong.extras import EXTRAS

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
    "unknown config field": (
        ["train", "rollout.grup_size=4"],
        "; did you mean 'group_size'?",
    ),
    "abbreviated flag": (
        ["train", "--trainer-rank", "2"],
        "unrecognized arguments: --trainer-rank; did you mean --trainer-ranks?",
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


# ------------------------------------------------------------------ no prefix matching

ABBREVIATED = {  # argv, the whole line: argparse would have run these as the longer flag
    "train": (
        ["train", "--trainer-rank", "2"],
        "furlong train: unrecognized arguments: --trainer-rank; did you mean --trainer-ranks? "
        "(see --help)",
    ),
    "train, after overrides": (
        ["train", "run.steps=1", "--ray-co"],
        "furlong train: unrecognized arguments: --ray-co; did you mean --ray-colocate? "
        "(see --help)",
    ),
    "serve": (
        ["serve", "--base-mod", "tiny-qwen3"],
        "furlong serve: unrecognized arguments: --base-mod tiny-qwen3; did you mean "
        "--base-model? (see --help)",
    ),
    "demo": (
        ["demo", "--alg", "ppo"],
        "furlong demo: unrecognized arguments: --alg; did you mean --algo? (see --help)",
    ),
}


@pytest.mark.parametrize("case", ABBREVIATED)
def test_an_abbreviated_flag_is_refused_with_the_whole_one(case: str, capsys) -> None:
    argv, line = ABBREVIATED[case]
    with pytest.raises(SystemExit) as stop:
        cli.parse(argv)
    assert stop.value.code == 2
    assert capsys.readouterr().err == line + "\n"


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_parser_of_the_cli_takes_a_prefix() -> None:
    parsers = list(_parsers(cli.build_parser()))
    assert len(parsers) == 1 + len(cli._commands(cli.build_parser()))
    assert [p.prog for p in parsers if p.allow_abbrev is not False] == []


SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("tools/*.py")])


def test_no_script_parser_takes_a_prefix() -> None:
    """Every ``ArgumentParser(...)`` in benchmarks/ and tools/ says ``allow_abbrev=False``."""
    calls = [
        (path.name, node)
        for path in SCRIPTS
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("ArgumentParser")
    ]
    assert len(calls) >= 10
    for name, call in calls:
        flags = {k.arg: k.value for k in call.keywords}
        off = flags.get("allow_abbrev")
        assert isinstance(off, ast.Constant) and off.value is False, name


# ------------------------------------------------------ the servers check before torch loads

# argv (PORT: a port this test holds), the line after "furlong COMMAND: "
PREFLIGHT = {
    "serve: missing keys file": (
        ["serve", "--api-keys-file", "nosuch-keys"],
        "--api-keys-file: cannot read 'nosuch-keys' (No such file or directory)",
    ),
    "serve: empty keys file": (
        ["serve", "--api-keys-file", "empty"],
        "--api-keys-file: 'empty' lists no keys",
    ),
    "serve: port in use": (
        ["serve", "--port", "PORT"],
        "--port: 127.0.0.1:PORT is in use (another server?); choose another --port",
    ),
    "serve: state dir is a file": (
        ["serve", "--state-dir", "empty"],
        "--state-dir: 'empty' is not a directory",
    ),
    "serve: hf home under a file": (
        ["serve", "--hf-home", "empty/hub"],
        "--hf-home: 'empty/hub' cannot be made (empty is a file)",
    ),
    "serve: a count below 1": (
        ["serve", "--max-datums", "0"],
        "--max-datums: expected an integer >= 1, got 0",
    ),
    "serve: a bound below its least": (
        ["serve", "--snapshot-engines", "0"],
        "--snapshot-engines: must be >= 1, got 0",
    ),
    "serve: a port past 65535": (
        ["serve", "--port", "70000"],
        "--port: expected 0..65535 (0: any free port), got 70000",
    ),
    "rollout-server: port in use": (
        ["rollout-server", "--port", "PORT"],
        "--port: 127.0.0.1:PORT is in use (another server?); choose another --port",
    ),
    "rollout-server: missing weights dir": (
        ["rollout-server", "--weights-dir", "nosuch-dir"],
        "--weights-dir: 'nosuch-dir': no such directory",
    ),
    "rollout-server: missing admin token file": (
        ["rollout-server", "--admin-token-file", "nosuch-token"],
        "--admin-token-file: cannot read nosuch-token (No such file or directory)",
    ),
    "rollout-server: no batch slots": (
        ["rollout-server", "--max-running", "0"],
        "--max-running: expected an integer >= 1, got 0",
    ),
    "session-server: port in use": (
        ["session-server", "--pause-mode", "abort", "--port", "PORT"],
        "--port: 127.0.0.1:PORT is in use (another server?); choose another --port",
    ),
    "session-server: missing weights dir": (
        ["session-server", "--pause-mode", "abort", "--weights-dir", "nosuch-dir"],
        "--weights-dir: 'nosuch-dir': no such directory",
    ),
    "session-server: short admin token": (
        ["session-server", "--pause-mode", "abort", "--admin-token-file", "short-token"],
        "--admin-token-file: the token in short-token has 5 characters; use at least 16",
    ),
}


@pytest.mark.parametrize("case", PREFLIGHT)
def test_a_server_refuses_a_bad_flag_or_port_before_torch_loads(case: str, tmp_path: Path) -> None:
    """One line naming the flag, exit 2, and torch not yet imported when it is said: a
    mechanism that answers at once, where the model would load first (a port in use was
    uvicorn's [Errno 98] after it)."""
    (tmp_path / "empty").write_text("")
    (tmp_path / "short-token").write_text("short\n")
    with socket.socket() as held:  # another server on the port (bound and listening)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        argv = [port if word == "PORT" else word for word in PREFLIGHT[case][0]]
        run = f"print(cli.main({argv!r}), 'torch' in sys.modules)"
        code = f"import sys; from furlong import cli; {run}"
        env = {k: v for k, v in os.environ.items() if k != "FURLONG_ADMIN_TOKEN"}
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env=env | {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=300,  # a hang guard, not a timing claim
        )
    assert done.stdout.split() == ["2", "False"], (done.stdout, done.stderr)
    line = PREFLIGHT[case][1].replace("PORT", port)
    assert done.stderr.splitlines() == [f"furlong {argv[0]}: {line}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "short-token"]  # no writes


@pytest.mark.parametrize(
    "argv", [["serve"], ["rollout-server"], ["session-server", "--pause-mode", "abort"]]
)
def test_without_the_server_extra_a_server_says_what_to_install(argv, monkeypatch, capsys) -> None:
    monkeypatch.setitem(EXTRAS, "server", ("fastapi", "no_such_module_xyz"))
    assert cli.main([*argv, "--port", "0"]) == 2
    assert capsys.readouterr().err == (
        f"furlong {argv[0]}: this command needs furlong's 'server' extra (no_such_module_xyz "
        "not installed): pip install 'furlong[server]'\n"
    )
