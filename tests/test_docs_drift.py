"""README.md and the docs state no number the code does not hold, link nothing outside the
repository, and list every model name furlong resolves.

Each claim is a pattern on a page and the values the code gives it: the pattern must still be
found (rewording the prose means updating the claim here), and every number it captures must
equal the code's. The recipe files are tied to the demo in tests/rl/test_documented_configs.py.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from furlong.demo import demo_config
from furlong.models.pretrained import model_names
from furlong.rl.config import load_config
from furlong.rl.tasks import reverse

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

DEMO = demo_config()
PPO = demo_config("ppo")
SMOLLM2 = load_config(ROOT / "examples" / "rl" / "smollm2.toml")
TRAIN, HELD_OUT = reverse(DEMO.task.max_a)
SHARE = inspect.signature(reverse).parameters["held_out"].default  # a hash split's target


def _count(text: str) -> float:
    """A number as the prose writes it: ``1,000``, ``1e-3``, ``70%`` (as 0.7), ``three``,
    ``a fifth``."""
    words = {"two": 2, "three": 3, "four": 4, "a fifth": 0.2, "a third": 1 / 3, "half": 0.5}
    if text.lower() in words:
        return words[text.lower()]
    if text.endswith("%"):
        return float(text[:-1]) / 100
    return float(text.replace(",", ""))


# (page, pattern whose groups are numbers, the values the code holds, in order)
CLAIMS: list[tuple[str, str, tuple[float, ...]]] = [
    ("README.md", r"reverse (\d+)-digit strings", (DEMO.task.max_a,)),
    (
        "README.md",
        r"in (\d+) steps it shows demonstrations of which (\d+%) echo",
        (DEMO.warmup.steps, DEMO.warmup.decoy_share),
    ),
    (
        "README.md",
        r"Then (\d+) GRPO steps \((\d+) prompts × (\d+) samples",
        (DEMO.run.steps, DEMO.rollout.prompts_per_step, DEMO.rollout.group_size),
    ),
    ("README.md", r"on (\d+) held-out\s+strings", (DEMO.task.eval_size,)),
    ("README.md", r"(\d+) critic-only\s+steps", (PPO.critic.warmup_steps,)),
    (
        "README.md",
        r"(\d+) GRPO steps \((\d+) prompts × (\d+) samples, full\s+fine-tuning, no warm-up\)",
        (
            SMOLLM2.run.steps,
            SMOLLM2.rollout.prompts_per_step,
            SMOLLM2.rollout.group_size,
        ),
    ),
    ("docs/index.md", r"reverse a string of (\w+) digits", (DEMO.task.max_a,)),
    (
        "docs/index.md",
        r"(A fifth) of the ([\d,]+) strings are held out",
        (SHARE, len(TRAIN) + len(HELD_OUT)),
    ),
    ("docs/index.md", r"measured on (\d+) of them", (DEMO.task.eval_size,)),
    (
        "docs/index.md",
        r"(\d+) cross-entropy steps \(lr ([\d.e-]+)\)",
        (DEMO.warmup.steps, DEMO.warmup.learning_rate),
    ),
    (
        "docs/index.md",
        r"where (\d+%) of the demonstrations echo.*?`warmup\.decoy_share = ([\d.]+)`",
        (DEMO.warmup.decoy_share, DEMO.warmup.decoy_share),
    ),
    (
        "docs/index.md",
        r"\*\*GRPO\*\*, (\d+) steps: each step samples (\d+) answers for each of (\d+) strings",
        (DEMO.run.steps, DEMO.rollout.group_size, DEMO.rollout.prompts_per_step),
    ),
    ("docs/index.md", r"(\d+) critic-only\s+steps", (PPO.critic.warmup_steps,)),
    ("docs/rl.md", r"to 98% after (\d+) GRPO steps", (DEMO.run.steps,)),
]


@pytest.mark.parametrize("page,pattern,values", CLAIMS, ids=[c[1][:40] for c in CLAIMS])
def test_the_prose_states_the_codes_numbers(page: str, pattern: str, values: tuple) -> None:
    text = " ".join((ROOT / page).read_text().split())  # a claim may wrap across lines
    found = re.findall(pattern, text, flags=re.S)
    assert found, f"{page}: no longer says {pattern!r}; update the claim in this test"
    for match in found:
        groups = match if isinstance(match, tuple) else (match,)
        said = tuple(_count(g) for g in groups)
        assert said == pytest.approx(values), f"{page}: {pattern!r} says {said}, code {values}"


def test_the_held_out_split_is_the_share_the_docs_give() -> None:
    assert abs(len(HELD_OUT) / (len(TRAIN) + len(HELD_OUT)) - SHARE) < 0.03  # hashed: about it


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code is not a link
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve_inside_the_repository(page: Path) -> None:
    for link in _links(page):
        if re.match(r"[a-z]+:", link) or link.startswith("#"):
            continue  # a URL or an anchor on the same page
        target = (page.parent / link.split("#")[0]).resolve()
        assert target.is_relative_to(ROOT), f"{page.name}: {link} points outside the repository"
        assert target.exists(), f"{page.name}: {link} does not exist"


def test_no_page_points_outside_the_repository_in_code_spans() -> None:
    for page in PAGES:
        for path in re.findall(r"`(\.\./[^`\s]+)`", page.read_text()):
            target = (page.parent / path).resolve()
            assert target.is_relative_to(ROOT) and target.exists(), f"{page.name}: {path}"


@pytest.mark.parametrize("page", ["README.md", "docs/models.md"])
def test_the_model_table_lists_every_name_furlong_resolves(page: str) -> None:
    text = (ROOT / page).read_text()
    table = re.search(r"^\| name \| model \| use \|\n(?:\|.*\n)+", text, re.M)
    assert table, f"{page}: no model table"
    listed = re.findall(r"^\| `([^`]+)` \|", table.group(0), re.M)
    assert sorted(listed) == sorted(model_names()), f"{page} lists {listed}"
