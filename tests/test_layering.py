"""The layering docs/contributing.md describes: train/ and rollout/ never import each other,
models/ and the bottom modules import nothing above them, and nothing in the package imports
the repository's tools, tests or benchmarks. Every import counts, function-local ones too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "furlong"
ABOVE = {"rl", "server", "cli", "demo", "env_report", "__main__"}  # env_report: the CLI's `env`
# what each part of the package must not import (a package or a top-level module of furlong)
FORBIDDEN = {
    "train": ABOVE | {"rollout"},
    "rollout": ABOVE | {"train"},
    "models": ABOVE | {"train", "rollout"},
    "bottom": ABOVE | {"train", "rollout", "models"},
}
OUTSIDE = {"tools", "tests", "benchmarks"}


def _part(path: Path) -> str:
    first = path.relative_to(PACKAGE).parts[0]
    if first.endswith(".py"):
        return "top" if first[:-3] in ABOVE else "bottom"
    return first


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            if node.module == "furlong":  # from furlong import rollout
                names |= {f"furlong.{a.name}" for a in node.names}
    return names


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_imports_follow_the_layers(path: Path) -> None:
    forbidden = FORBIDDEN.get(_part(path), set())
    for name in _imports(path):
        top, _, rest = name.partition(".")
        assert top not in OUTSIDE, f"{path.name} imports {name}"
        if top == "furlong" and rest:
            assert rest.split(".")[0] not in forbidden, f"{_part(path)}/ imports {name}"


# What the CLI imports before a command runs: none of it may load torch, transformers or the
# server stack, so `furlong --help`, `--version`, usage errors and the servers' flag and port
# checks answer at once (benchmarks/cli_startup.py).
LIGHT = [
    "furlong",
    "furlong.cli",
    "furlong.listen",
    "furlong.models.names",
    "furlong.models.presets",
    "furlong.models.pretrained",
    "furlong.rl.config_source",
    "furlong.rollout.control",
    "furlong.server.main",
]


@pytest.mark.parametrize("module", LIGHT)
def test_the_cli_start_imports_no_framework(module: str) -> None:
    import subprocess
    import sys

    heavy = {"torch", "transformers", "fastapi", "uvicorn"}
    code = f"import sys, {module}; print(sorted({heavy!r} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
