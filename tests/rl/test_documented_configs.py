"""The documented RL config is the demo: `examples/rl/reverse.toml`, the docs' TOML block and
`furlong demo` cannot drift apart. That a short budget of it learns under every rounding is
tests/rl/test_demo_robustness.py."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

from furlong.demo import demo_config
from furlong.rl.config import load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "rl" / "reverse.toml"


def test_the_recipe_file_is_the_demo() -> None:
    assert load_config(RECIPE) == demo_config(out_dir="runs/rl")  # the file has no out_dir


def test_the_docs_show_the_recipe_file() -> None:
    page = (ROOT / "docs" / "rl.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", page, re.S)
    assert tomllib.loads(blocks[0]) == tomllib.loads(RECIPE.read_text())


def test_the_smollm2_recipe_is_its_recorded_run() -> None:
    """docs/recipes/smollm2.md's table comes from a run of exactly examples/rl/smollm2.toml."""
    recorded = load_config(ROOT / "docs" / "recipes" / "runs" / "smollm2-grpo" / "config.toml")
    assert load_config(ROOT / "examples" / "rl" / "smollm2.toml") == recorded


def test_the_chain_sum_recipe_is_its_recorded_run() -> None:
    """docs/recipes/smollm2-chain-sum.md's numbers come from a run of
    examples/rl/smollm2_chain_sum.toml: the same config but where the run's outputs went (a
    scratch directory, no export, no bars)."""
    recorded = load_config(ROOT / "docs" / "recipes" / "runs" / "smollm2-chain-sum" / "config.toml")
    recipe = load_config(ROOT / "examples" / "rl" / "smollm2_chain_sum.toml")
    outputs = {"out_dir": "", "export_hf": True, "tensorboard": True, "progress": True}
    assert dataclasses.replace(recipe, run=dataclasses.replace(recipe.run, **outputs)) == (
        dataclasses.replace(recorded, run=dataclasses.replace(recorded.run, **outputs))
    )
