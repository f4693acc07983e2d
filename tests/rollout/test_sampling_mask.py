"""SamplingMask: CSR invariants, owned copies, and the list/concatenate/prefix/select algebra."""

from __future__ import annotations

import pytest
import torch

from furlong.errors import InputError
from furlong.rollout.sampling_mask import SamplingMask

ROWS = [[5, 9, 2], [7], [1, 3], [4, 8, 6, 0]]


def test_from_lists_builds_csr_with_pinned_dtypes() -> None:
    m = SamplingMask.from_lists(ROWS)
    ids, offsets = m.tensors()
    assert ids.dtype == torch.int32 and offsets.dtype == torch.int64
    assert ids.tolist() == [5, 9, 2, 7, 1, 3, 4, 8, 6, 0]
    assert offsets.tolist() == [0, 3, 4, 6, 10]
    assert len(m) == 4 and m.to_lists() == ROWS and m.row(-1) == [4, 8, 6, 0]


@pytest.mark.parametrize(
    "ids, offsets, message",
    [
        ([1, 2], [1, 2], "start with 0"),
        ([1, 2], [0, 1], "end with len"),
        ([1, 2, 3], [0, 2, 2, 3], "position 1 has an empty support"),
        ([1, 2, 3], [0, 3, 1, 3], "empty support"),
        ([1, 2], [], "start with 0"),
        ([-1, 2], [0, 1, 2], ">= 0"),
        ([1.0, 2.0], [0, 1, 2], "integers"),
        ([True, False], [0, 1, 2], "integers"),
        ([1, 2], [0.0, 1.0, 2.0], "integers"),
        ([[1, 2]], [0, 1, 2], "1-D"),
    ],
)
def test_invalid_input_is_rejected(ids, offsets, message: str) -> None:
    def tensor(values: list) -> torch.Tensor:  # an empty list would otherwise become float
        return torch.tensor(values, dtype=torch.int64) if values == [] else torch.tensor(values)

    with pytest.raises(InputError, match=message):
        SamplingMask(tensor(ids), tensor(offsets))


def test_empty_rows_in_from_lists_are_rejected() -> None:
    with pytest.raises(InputError, match="position 1 has an empty support"):
        SamplingMask.from_lists([[1], [], [2]])


def test_tensors_are_owned_copies_and_mask_is_immutable() -> None:
    ids, offsets = torch.tensor([3, 4, 5], dtype=torch.int32), torch.tensor([0, 1, 3])
    m = SamplingMask(ids, offsets)
    ids[0], offsets[1] = 99, 2
    assert m.to_lists() == [[3], [4, 5]]
    assert m.tensors()[0].data_ptr() != ids.data_ptr()
    with pytest.raises(AttributeError):
        m._ids = ids  # type: ignore[misc]


def test_concatenate_rebases_offsets() -> None:
    a, b = SamplingMask.from_lists(ROWS[:2]), SamplingMask.from_lists(ROWS[2:])
    joined = SamplingMask.concatenate([a, SamplingMask.singletons([11, 12]), b])
    assert joined.to_lists() == ROWS[:2] + [[11], [12]] + ROWS[2:]
    assert joined.tensors()[1].tolist() == [0, 3, 4, 5, 6, 8, 12]
    assert len(SamplingMask.concatenate([])) == 0


def test_prefix_round_trips_with_concatenate() -> None:
    m = SamplingMask.from_lists(ROWS)
    for n in range(len(ROWS) + 1):
        head = m.prefix(n)
        assert head.to_lists() == ROWS[:n]
        tail = SamplingMask.from_lists(ROWS[n:]) if n < len(ROWS) else None
        assert SamplingMask.concatenate([head] + ([tail] if tail else [])) == m
    with pytest.raises(InputError, match="prefix"):
        m.prefix(5)


def test_select_arbitrary_rows() -> None:
    m = SamplingMask.from_lists(ROWS)
    flat, lengths = m.select([3, 1, 2, 0])
    assert flat.tolist() == [4, 8, 6, 0, 7, 1, 3, 5, 9, 2]
    assert lengths.tolist() == [4, 1, 2, 3] and flat.dtype == torch.int32
    flat, lengths = m.select([1, 2, 3])  # one contiguous run
    assert flat.tolist() == [7, 1, 3, 4, 8, 6, 0] and lengths.tolist() == [1, 2, 4]
    flat, lengths = m.select([])
    assert flat.numel() == 0 and lengths.numel() == 0
    with pytest.raises(IndexError):
        m.select([4])


def test_contains_checks_sampled_token_membership() -> None:
    m = SamplingMask.from_lists(ROWS)
    assert m.contains([2, 7, 4, 0]).tolist() == [True, True, False, True]
    with pytest.raises(InputError, match="need 4 tokens"):
        m.contains([1, 2])


def test_singletons_and_equality() -> None:
    s = SamplingMask.singletons(torch.tensor([3, 1, 4]))
    assert s.to_lists() == [[3], [1], [4]]
    assert s == SamplingMask.from_lists([[3], [1], [4]])
    assert s != SamplingMask.from_lists([[3], [1, 4]])
