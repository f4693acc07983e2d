"""The one check that named tensors fit an expected name -> shape table: a checkpoint against
the model it loads into, published weights against the rollout engine's, a critic's trunk
against its source. Every message starts with the caller's ``where``.

Imports nothing of furlong but the error type: every package may use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from furlong.errors import InputError

if TYPE_CHECKING:
    import torch

SHOWN = 4  # names listed in a message at most


def _shape(x: torch.Tensor | Sequence[int]) -> tuple[int, ...]:
    """A tensor's shape, or a shape as it is (a checkpoint's metadata holds sizes only)."""
    return tuple(x.shape if hasattr(x, "shape") else x)


def check_names_and_shapes(
    tensors: Mapping[str, torch.Tensor | Sequence[int]],
    expected: Mapping[str, torch.Tensor | Sequence[int]],
    where: str,
    *,
    theirs: str = "the model's",
    subset: bool = False,
) -> None:
    """Every name of ``tensors`` is in ``expected`` with the same shape, or an InputError:

        {where}: missing tensors [...], unknown tensors [...]
        {where}: 'name' has shape (2, 3), {theirs} is (3, 2)

    ``subset``: ``tensors`` may leave names out (a partial weight update), so only unknown
    names are refused. Names are checked before any shape."""
    unknown = sorted(set(tensors) - set(expected))
    missing = [] if subset else sorted(set(expected) - set(tensors))
    if missing or unknown:
        parts = [f"missing tensors {missing[:SHOWN]}"] if missing else []
        parts += [f"unknown tensors {unknown[:SHOWN]}"] if unknown else []
        raise InputError(f"{where}: {', '.join(parts)}")
    for name, tensor in tensors.items():
        got, want = _shape(tensor), _shape(expected[name])
        if got != want:
            raise InputError(f"{where}: {name!r} has shape {got}, {theirs} is {want}")
