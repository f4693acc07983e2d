"""Recipe pages: every healthy-run table is exactly what its recorded run gives, and every
recorded run's config loads (so `furlong train <run>/config.toml` reproduces it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from furlong.metrics import read_metrics
from furlong.rl.config import load_config
from tools import healthy_runs as health

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(p for p in (ROOT / "docs" / "recipes").glob("*.md") if p.name != "index.md")


def test_there_are_recipe_pages() -> None:
    assert {p.stem for p in PAGES} >= {"qwen3-dense", "qwen3-moe", "llama"}


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_healthy_run_tables_come_from_recorded_runs(page: Path) -> None:
    text = page.read_text()
    blocks = list(health.MARKER.finditer(text))
    assert blocks, f"{page.name}: no healthy-run table"
    assert health.render(text) == text, (
        f"{page.name} differs from its recorded run: python -m tools.healthy_runs {page}"
    )
    for block in blocks:
        run = ROOT / block["run"]
        config = load_config(run / "config.toml")
        rows = read_metrics(run / "metrics.jsonl")
        steps = [r["step"] for r in rows]
        assert steps == list(range(config.run.steps + 1)), run
        assert int(block["last"]) <= config.run.steps
        assert "logprob_diff:mean" in rows[1] and "eval_greedy" in rows[0]
