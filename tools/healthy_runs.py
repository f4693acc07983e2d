"""'What a healthy run looks like': metric ranges from a recorded run, for the recipe pages.

A recipe page embeds a table between markers that name the recorded run directory (its
``config.toml`` and ``metrics.jsonl`` live in the repository) and the step window:

    <!-- healthy-run: docs/recipes/runs/NAME steps 1-150 -->
    ...generated table...
    <!-- end healthy-run -->

    python -m tools.healthy_runs docs/recipes/*.md   # regenerate every table

A test checks every page holds exactly what its recorded run gives, so a table cannot drift
from its run.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

from furlong.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
METRICS = {
    "reward:mean": "reward (mean over the step's samples)",
    "kl:mean": "KL to the start policy (k1, per token)",
    "logprob_diff:mean": "train/rollout log-prob diff (mean abs, per token)",
    "grad_norm:mean": "grad norm (before clipping)",
    "entropy:mean": "entropy (-mean log-prob of sampled tokens)",
    "eval_greedy": "held-out greedy accuracy",
    "eval_pass1": "held-out pass@1",
}
MARKER = re.compile(
    r"<!-- healthy-run: (?P<run>\S+) steps (?P<first>\d+)-(?P<last>\d+) -->\n.*?"
    r"<!-- end healthy-run -->",
    flags=re.S,
)


def _fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.1e}"


def healthy_table(run_dir: Path, first: int, last: int) -> str:
    """Min, median and max of each metric over steps ``first..last`` of a recorded run."""
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if first <= r["step"] <= last]
    if not rows:
        raise ValueError(f"{run_dir}: no steps in {first}-{last}")
    lines = [
        f"| metric | min | median | max | steps {first}–{last} |",
        "|---|---|---|---|---|",
    ]
    for key, meaning in METRICS.items():
        values = [r[key] for r in rows if key in r]
        if values:
            lo, mid, hi = min(values), statistics.median(values), max(values)
            lines.append(f"| {meaning} | {_fmt(lo)} | {_fmt(mid)} | {_fmt(hi)} | {len(values)} |")
    return "\n".join(lines)


def render(page_text: str) -> str:
    """The page with every healthy-run block regenerated from its recorded run."""

    def block(match: re.Match) -> str:
        run, first, last = match["run"], int(match["first"]), int(match["last"])
        table = healthy_table(ROOT / run, first, last)
        return (
            f"<!-- healthy-run: {run} steps {first}-{last} -->\n{table}\n\n"
            f"Measured from `{run}/metrics.jsonl` (config: `{run}/config.toml`).\n"
            "<!-- end healthy-run -->"
        )

    return MARKER.sub(block, page_text)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        page = Path(name)
        text = page.read_text()
        new = render(text)
        if new != text:
            page.write_text(new)
        print(f"{page}: {'rewritten' if new != text else 'up to date'}")
