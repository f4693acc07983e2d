"""The "did you mean" hint every front door's messages share (furlong.errors)."""

from __future__ import annotations

from furlong.errors import did_you_mean, nearest


def test_the_hint_names_the_closest_known_name_or_nothing() -> None:
    fields = ["group_size", "max_tokens", "top_k"]
    assert did_you_mean("grup_size", fields) == "; did you mean 'group_size'?"
    assert did_you_mean("zzzzzz", fields) == ""
    assert did_you_mean("--prot", ["--host", "--port"], quote=str) == "; did you mean --port?"


def test_an_abbreviation_means_the_name_it_begins() -> None:
    flags = ["--ray", "--ray-colocate", "--rollout-engines"]
    assert nearest("--ray-co", flags) == "--ray-colocate"  # --ray is nearer by ratio alone
    assert nearest("--ray", flags) == "--ray"  # a whole name is itself
    assert nearest("--trainer-rank", ["--trainer-ranks", "--resume"]) == "--trainer-ranks"
