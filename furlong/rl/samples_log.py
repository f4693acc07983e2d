"""``samples.jsonl``: what the policy said, one line per reply.

Each held-out evaluation writes its replies (greedy and sampled), and with ``run.samples_every
= N`` every Nth step writes the replies it trained on: the step, ``mode`` (greedy | sampled |
train), the prompt, the reference answer, the completion, what ``task.extract`` took from it,
the reward, the verifier's verdict (``correct``) and whether it stopped. ``furlong eval RUN
--show`` prints them. Lines are appended as they come; a resumed run keeps those up to its
checkpoint's step, as ``metrics.jsonl`` does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from furlong.atomic import atomic_write_text
from furlong.metrics import kept_lines
from furlong.rl.evaluation import Reply

FILE = "samples.jsonl"


class SamplesLog:
    def __init__(self, path: str | os.PathLike, resume_from_step: int | None = None) -> None:
        self.path = Path(path)
        kept = kept_lines(self.path, resume_from_step) if resume_from_step is not None else []
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def write(self, step: int, replies: Iterable[Reply]) -> None:
        with self.path.open("a") as f:
            f.write("".join(json.dumps(r.row(step)) + "\n" for r in replies))


def read_samples(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The rows of a ``samples.jsonl`` (a torn last line, from a crash, skipped)."""
    for line in Path(path).read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue
