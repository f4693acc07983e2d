"""tests/conftest.py's SLOW list names tests that exist: a renamed or deleted test must not
silently move its replacement into the fast tier's blind spot or leave a dead entry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import SLOW, is_slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("entry", SLOW)
def test_every_slow_entry_names_a_test(entry: str) -> None:
    module, _, rest = entry.partition("::")
    source = ROOT / module
    assert source.is_file(), f"{entry}: no such module"
    if rest:
        name = rest.partition("[")[0]
        assert re.search(rf"^(async )?def {name}\(", source.read_text(), re.M), entry


def test_entries_match_modules_functions_and_parameters_only() -> None:
    assert is_slow("tests/server/test_malformed_corpus.py::test_refused_cleanly[fb-x]")
    assert is_slow("tests/test_cli.py::test_demo_smoke")
    assert is_slow("tests/test_docs.py::test_docs_example_runs[docs/scaling.md[python block 0]]")
    one = "tests/test_cli_errors.py::test_a_user_error_is_one_line"
    assert is_slow(f"{one}[flag after overrides]")
    assert not is_slow(f"{one}[missing config file]")
    assert not is_slow("tests/test_cli.py::test_demo_smoke_other")
    assert not is_slow("tests/train/test_distributed.py::test_rank_split_covers_every_datum_once")
