"""The docs site builds with ``mkdocs build --strict``: a broken link, a missing page or a
page left out of the navigation fails the suite (as ``make docs`` does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_site_builds_strictly(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "index.html").exists()
    for page in ("concepts", "rl", "tinker-service", "rollout", "memory", "troubleshooting"):
        assert (tmp_path / page / "index.html").exists(), page
