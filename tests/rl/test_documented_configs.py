"""The documented RL config learns: `examples/rl/reverse.toml` is the demo's recipe (the file,
the docs' TOML block and `furlong demo` cannot drift apart), and a short budget of it already
lifts held-out accuracy above what the warm-up left."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from furlong.demo import demo_config
from furlong.rl.config import load_config
from furlong.rl.loop import train

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "rl" / "reverse.toml"


def test_the_recipe_file_is_the_demo() -> None:
    assert load_config(RECIPE) == demo_config(out_dir="runs/rl")  # the file has no out_dir


def test_the_docs_show_the_recipe_file() -> None:
    page = (ROOT / "docs" / "rl.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", page, re.S)
    assert tomllib.loads(blocks[0]) == tomllib.loads(RECIPE.read_text())


def test_a_short_budget_of_the_recipe_lifts_held_out_accuracy(tmp_path) -> None:
    config = load_config(
        RECIPE,
        [
            "run.steps=20",
            "run.eval_every=20",
            "run.progress=false",
            "run.export_hf=false",
            "run.log_kl=false",
            f"run.out_dir={tmp_path}",
        ],
    )
    summary = train(config)
    before, after = summary.before["eval_greedy"], summary.after["eval_greedy"]
    assert after >= before + 0.15, (before, after)
