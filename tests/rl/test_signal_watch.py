"""The no-learning-signal warning: loud once early, again at the end, silent on a healthy run."""

from __future__ import annotations

import io
import re
from pathlib import Path

from furlong.demo import DEMO
from furlong.rl.config import load_config
from furlong.rl.signal_watch import ADVICE, SignalWatch


def run(skipped_per_step: list[float], minibatches: int = 2) -> tuple[str, float]:
    out = io.StringIO()
    watch = SignalWatch(minibatches, early_steps=3, stream=out)
    watch.observe({"reward:mean": 0.0})  # a critic-only step: not counted
    for s in skipped_per_step:
        watch.observe({"actor_skipped:sum": s})
    fraction = watch.finish()
    return out.getvalue(), fraction


def test_a_run_without_signal_is_warned_early_and_at_the_end() -> None:
    text, fraction = run([2, 2, 2, 1, 2])  # 9 of 10 minibatches skipped
    assert fraction == 0.9
    assert text.count("WARNING") == 2
    assert "after 3 steps, 100% skipped" in text and "90% of the run's minibatches" in text
    assert "warmup.steps" in text


def test_a_run_with_signal_stays_quiet() -> None:
    text, fraction = run([0, 1, 0, 0, 1])  # 2 of 10
    assert fraction == 0.2 and text == ""


def test_a_late_collapse_is_reported_at_the_end_only() -> None:
    text, fraction = run([0, 0, 0, 2, 2, 2, 2, 2])  # 10 of 16, after a healthy start
    assert fraction == 0.625
    assert text.count("WARNING") == 1 and "62% of the run's minibatches" in text


def test_the_advice_is_the_demo_recipe_that_gets_a_random_model_a_signal() -> None:
    """The warm-up the warning recommends is the demo's noisy teacher, value for value, in the
    example file it names: the recipe measured to give RL a signal on any CPU."""
    text = " ".join(ADVICE.split())
    named = re.findall(r"(warmup\.\w+)=(\S+?)[;)\s]", text)
    assert {k for k, _ in named} == {"warmup.steps", "warmup.learning_rate", "warmup.decoy_share"}
    example = load_config(Path(__file__).parents[2] / "examples/rl/reverse.toml", [])
    for key, value in named:
        assert f"{key}={value}" in DEMO, key
        field = key.removeprefix("warmup.")
        assert getattr(example.warmup, field) == type(getattr(example.warmup, field))(value), key
    assert "examples/rl/reverse.toml" in text and "e.g. 200" not in text
    assert "all right" in text  # a solved task has no signal either: advice for both cases
