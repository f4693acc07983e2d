"""The Python examples of README.md and docs/*.md run, so the docs cannot rot."""

from __future__ import annotations

import re
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


def test_docs_have_examples() -> None:
    assert any(name.startswith("README") for name, _ in BLOCKS)
    assert any(name.startswith("docs") for name, _ in BLOCKS)


@pytest.mark.parametrize("name,block", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_docs_example_runs(name: str, block: str, tmp_path, monkeypatch) -> None:
    code = compile(block, name, "exec")
    monkeypatch.chdir(tmp_path)  # examples may write run directories
    if "tinker.ServiceClient" in block:
        # what the docs' bash block starts: furlong serve with a familiar name mapped
        # (started with --jwt-auth for the whoami example, which needs it)
        config = ServiceConfig(
            {"Qwen/Qwen3-8B-Base": "tiny-qwen3"}, tmp_path / "state", jwt_auth="whoami" in block
        )
        with background_server(create_app(Service(config))) as url:
            monkeypatch.setenv("TINKER_BASE_URL", url)
            monkeypatch.setenv("TINKER_API_KEY", "tml-local")
            monkeypatch.setenv("TINKER_TELEMETRY", "0")
            exec(code, {})
        return
    exec(code, {})
