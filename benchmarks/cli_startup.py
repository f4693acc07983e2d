"""How long `furlong` takes to answer before it does any work: `--help`, `--version`, a
command's `--help`, a mistyped model name (offline), and `furlong serve` given a missing
keys file or a port in use (one this script holds), this checkout against a baseline checkout
(e.g. a ``git worktree`` of an older commit), alternating in one invocation:

    git worktree add /tmp/before 4f35d96
    .venv/bin/python benchmarks/cli_startup.py --baseline-checkout /tmp/before --rounds 7

Each timing is a fresh ``python -m furlong ...`` process (wall clock, interpreter start
included), with `python -c "import torch"` measured beside it as the floor a torch-importing
command cannot beat. Medians per side and their ratio (this / baseline; below 1 is faster)."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAST = {  # answered without touching a model: repeated --rounds times
    "furlong --help": ["-m", "furlong", "--help"],
    "furlong --version": ["-m", "furlong", "--version"],
    "furlong serve --help": ["-m", "furlong", "serve", "--help"],
    "furlong train --help": ["-m", "furlong", "train", "--help"],
    "python -c 'import torch'": ["-c", "import torch"],
}
SLOW = {  # once per side: the baseline may spend minutes on a model, or load one first
    "train model.name=tiny-qwen4": ["-m", "furlong", "train", "model.name=tiny-qwen4"],
    "serve --base-model Qwen/Qwen3-8B-Base": [
        "-m",
        "furlong",
        "serve",
        "--base-model",
        "Qwen/Qwen3-8B-Base",
        "--port",
        "0",
    ],
    # answered before torch loads since the up-front checks; the baseline may load the model
    "serve --api-keys-file (missing)": ["-m", "furlong", "serve", "--api-keys-file", "nosuch"],
    "serve --port (in use)": ["-m", "furlong", "serve", "--port", "HELD"],
}


def one_run(checkout: Path, argv: list[str], timeout: float) -> tuple[float, str]:
    """Seconds to exit, and how it ended ("exit N", or "still running" past ``timeout``: a
    server that started although it cannot serve what it advertises). The environment is
    this shell's: run it where the hub is unreachable and HF_HUB_OFFLINE is unset, as a
    first-time user offline would be."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    with tempfile.TemporaryDirectory() as cwd:  # serve's state dir and train's runs land here
        start = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, *argv], cwd=cwd, env=env, capture_output=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return time.perf_counter() - start, "still running"
        return time.perf_counter() - start, f"exit {done.returncode}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--baseline-checkout", required=True, help="the tree to compare with")
    parser.add_argument("--rounds", type=int, default=7, help="runs per side of each fast case")
    parser.add_argument("--slow-timeout", type=float, default=120.0, help="seconds, model cases")
    args = parser.parse_args()
    sides = {"baseline": Path(args.baseline_checkout).resolve(), "this": ROOT}
    print(f"{'command':40} {'baseline s':>10} {'this s':>8} {'ratio':>6}  endings")
    for name, argv in FAST.items():
        times: dict[str, list[float]] = {side: [] for side in sides}
        endings: dict[str, str] = {}
        for i in range(args.rounds):
            for side in sides if i % 2 == 0 else reversed(list(sides)):
                seconds, endings[side] = one_run(sides[side], argv, 60.0)
                times[side].append(seconds)
        _row(name, {side: statistics.median(t) for side, t in times.items()}, endings)
    with socket.socket() as held:  # another server on the port of "serve --port (in use)"
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        for name, argv in SLOW.items():
            argv = [port if word == "HELD" else word for word in argv]
            runs = {side: one_run(sides[side], argv, args.slow_timeout) for side in sides}
            _row(name, {s: r[0] for s, r in runs.items()}, {s: r[1] for s, r in runs.items()})


def _row(name: str, seconds: dict[str, float], endings: dict[str, str]) -> None:
    ratio = seconds["this"] / seconds["baseline"]
    ended = f"baseline {endings['baseline']}, this {endings['this']}"
    print(f"{name:40} {seconds['baseline']:10.2f} {seconds['this']:8.2f} {ratio:6.2f}  {ended}")


if __name__ == "__main__":
    main()
