"""The README's Python examples run, so the docs cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from furlong.server.app import create_app
from furlong.server.service import Service, ServiceConfig
from furlong.serving import background_server

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples() -> None:
    assert BLOCKS


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int, tmp_path, monkeypatch) -> None:
    code = compile(BLOCKS[index], f"README.md[python block {index}]", "exec")
    if "tinker.ServiceClient" in BLOCKS[index]:
        # what the README's bash block starts: furlong serve with a familiar name mapped
        config = ServiceConfig({"Qwen/Qwen3-8B-Base": "tiny-qwen3"}, tmp_path / "state")
        with background_server(create_app(Service(config))) as url:
            monkeypatch.setenv("TINKER_BASE_URL", url)
            monkeypatch.setenv("TINKER_API_KEY", "tml-local")
            monkeypatch.setenv("TINKER_TELEMETRY", "0")
            exec(code, {})
        return
    exec(code, {})
