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

ADVICE = (
    "most RL minibatches had no learning signal (every sample in each group got the same "
    "reward), so they took no optimizer step. A policy that never succeeds needs a supervised "
    "warm-up (warmup.steps, e.g. 200) or an easier task; one that always succeeds needs a "
    "harder one. Check the reward with a few samples by hand."
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
