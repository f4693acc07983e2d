"""A loud warning when RL is not learning because there is nothing to learn from.

A minibatch whose advantages are all zero (every sample of every group got the same reward:
a random model that never succeeds, or a task already solved) takes no optimizer step. A run
where that is most steps looks healthy in its logs and changes nothing, so say so on stderr
while the run is young, and again at the end.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TextIO

# Why not "warmup.steps=200": a warm-up from a clean teacher that stops on its learning curve's
# steep part ends where the CPU's rounding puts it (the demo's old 150-step one: 0% held-out on
# one machine, 54% on another; BENCHMARKS.md "Demo robustness"), so it may fix nothing. One that
# converges to a mix of right and wrong answers works on any CPU: the demo's noisy teacher
# (furlong/demo.py; tests/rl/test_signal_watch.py holds the numbers below to it).
ADVICE = (
    "most RL minibatches had no learning signal: in every group all samples got the same "
    "reward (all wrong, or all right), so they took no optimizer step. RL learns from groups "
    "where some samples succeed and some fail. A policy that never succeeds needs a warm-up "
    "that leaves it right part of the time on any CPU: a noisy teacher, as in "
    "examples/rl/reverse.toml (warmup.steps=300 warmup.learning_rate=1e-3 "
    "warmup.decoy_share=0.7; the task needs decoy answers). More warm-up steps without decoys "
    "may end all wrong again, or all right, which has no signal either. A policy that always "
    "succeeds needs a harder task; more samples per group (rollout.group_size) let a rare "
    "success or failure show up. Check the reward on a few samples by hand."
)


class SignalWatch:
    """Counts skipped actor minibatches (``actor_skipped:sum``) against those run."""

    def __init__(
        self,
        minibatches: int,
        early_steps: int = 5,
        threshold: float = 0.8,
        stream: TextIO | None = None,
    ):
        self.minibatches = minibatches
        self.early_steps = early_steps
        self.threshold = threshold
        self.stream = stream
        self.steps = 0
        self.skipped = 0.0
        self.warned = False

    def observe(self, metrics: Mapping[str, float]) -> None:
        if "actor_skipped:sum" not in metrics:  # the critic-only warm-up trains no actor
            return
        self.steps += 1
        self.skipped += metrics["actor_skipped:sum"]
        if not self.warned and self.steps >= self.early_steps and self.fraction >= self.threshold:
            self._say(f"after {self.steps} steps, {self.fraction:.0%} skipped")
            self.warned = True

    @property
    def fraction(self) -> float:
        return self.skipped / max(1, self.steps * self.minibatches)

    def finish(self) -> float:
        """Warn again at the end when more than half was skipped; returns the fraction."""
        if self.steps and self.fraction > 0.5:
            self._say(f"{self.fraction:.0%} of the run's minibatches skipped")
        return self.fraction

    def _say(self, what: str) -> None:
        stream = self.stream or sys.stderr
        print(f"\nfurlong train: WARNING: {what}: {ADVICE}\n", file=stream, flush=True)
