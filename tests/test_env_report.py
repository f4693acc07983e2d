"""`furlong env`: the report names this install and the fused kernels' real state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import furlong
from furlong import cli
from furlong.env_report import collect, render
from furlong.models import fused_kernels as fk


def test_the_report_names_this_install_and_its_kernels() -> None:
    report = collect()
    assert report["furlong"] == furlong.__version__
    assert Path(report["location"]) == Path(furlong.__file__).parent
    assert report["libraries"]["torch"].startswith("2.")
    assert set(report["extras"]) == {"server", "ray", "tasks"}
    kernels, detail = fk.kernel_build()
    assert report["fused_kernels"] == ("built" if kernels is not None else "unavailable")
    assert report["fused_kernels_detail"] == detail
    text = render(report)
    assert f"fused kernels  {report['fused_kernels']}: {detail}" in text.splitlines()
    assert json.loads(render(report, as_json=True)) == report


def test_kernels_switched_off_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FURLONG_FUSED_KERNELS", "0")
    fk.kernel_build.cache_clear()
    try:
        report = collect()
    finally:
        monkeypatch.undo()
        fk.kernel_build.cache_clear()
    assert report["fused_kernels"] == "unavailable"
    assert report["fused_kernels_detail"] == "off (FURLONG_FUSED_KERNELS=0)"


def test_missing_sources_are_reported_not_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a wheel without its C files did: now a named error, not a quiet fallback."""
    monkeypatch.setattr(fk, "HEADER", Path("/nonexistent/fused_ops.h"))
    fk.kernel_build.cache_clear()
    try:
        kernels, detail = fk.kernel_build()
    finally:
        monkeypatch.undo()
        fk.kernel_build.cache_clear()
    assert kernels is None
    assert detail == (
        "furlong's package is incomplete (reinstall it): ['/nonexistent/fused_ops.h'] missing"
    )


def test_the_command_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["env", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["furlong"] == furlong.__version__
