"""Error types shared by every front door (Python API, RL loop, Tinker service), and the
"did you mean" hint their messages give for a mistyped name."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable


class InputError(ValueError):
    """A request was malformed. Raised before any state changed; the message names the field
    and, for batched requests, the datum index."""


def nearest(word: str, known: Iterable[str]) -> str | None:
    """The name in ``known`` closest to ``word``, if one is close (difflib's ratio >= 0.6). A
    word that begins longer names is taken as an abbreviation of one of them (``--ray-co``:
    ``--ray-colocate``, though ``--ray`` is nearer by ratio)."""
    names = list(known)
    if word in names:
        return word
    longer = [name for name in names if name.startswith(word)]
    if longer and len(word.lstrip("-")) >= 2:
        return difflib.get_close_matches(word, longer, n=1, cutoff=0)[0]
    found = difflib.get_close_matches(word, names, n=1)
    return found[0] if found else None


def did_you_mean(word: str, known: Iterable[str], quote: Callable[[str], str] = repr) -> str:
    """``"; did you mean 'group_size'?"`` for the name in ``known`` closest to ``word``, or ""
    when none is close: the tail of a message that names ``word`` as unknown."""
    found = nearest(word, known)
    return "" if found is None else f"; did you mean {quote(found)}?"
