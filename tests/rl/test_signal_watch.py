"""The no-learning-signal warning: loud once early, again at the end, silent on a healthy run."""

from __future__ import annotations

import io

from furlong.rl.signal_watch import SignalWatch


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
