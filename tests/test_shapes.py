"""furlong.shapes.check_names_and_shapes: names first, then shapes; every message starts with
the caller's ``where``."""

from __future__ import annotations

import pytest
import torch

from furlong.errors import InputError
from furlong.shapes import check_names_and_shapes

EXPECTED = {"a": torch.zeros(2, 3), "b": (4,)}


def test_matching_tensors_and_shapes_pass() -> None:
    check_names_and_shapes({"a": torch.ones(2, 3), "b": [4]}, EXPECTED, "here")
    check_names_and_shapes({"b": torch.ones(4)}, EXPECTED, "here", subset=True)


@pytest.mark.parametrize(
    "tensors, subset, message",
    [
        ({"a": (2, 3)}, False, r"^load: missing tensors \['b'\]$"),
        ({"a": (2, 3), "b": (4,), "c": ()}, False, r"^load: unknown tensors \['c'\]$"),
        ({"c": ()}, False, r"^load: missing tensors \['a', 'b'\], unknown tensors \['c'\]$"),
        ({"c": ()}, True, r"^load: unknown tensors \['c'\]$"),
        ({"a": (3, 2)}, True, r"^load: 'a' has shape \(3, 2\), the model's is \(2, 3\)$"),
    ],
)
def test_messages(tensors, subset, message) -> None:
    with pytest.raises(InputError, match=message):
        check_names_and_shapes(tensors, EXPECTED, "load", subset=subset)
