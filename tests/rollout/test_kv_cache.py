"""The batch's KV cache: a leave moves rows from the end into the freed places (no re-layout),
a wide common left padding is trimmed by a full re-layout, and decode steps after a leave
append to the right rows."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from furlong.models import build_preset
from furlong.rollout import kv_cache

ROWS, KV_HEADS, WIDTH, HEAD_DIM = 5, 2, 6, 4


def _filled_cache(mask: torch.Tensor) -> tuple[DynamicCache, list[torch.Tensor]]:
    """A cache over ``mask``'s rows whose every layer holds distinct random keys (values are
    keys + 100), and those keys."""
    model, _ = build_preset("tiny-qwen3", seed=0)
    cache = kv_cache.new_cache(model.config)
    keys = []
    for layer in cache.layers:
        k = torch.randn(mask.shape[0], KV_HEADS, mask.shape[1], HEAD_DIM)
        layer.update(k, k + 100)
        keys.append(k)
    return cache, keys


def test_a_leave_moves_rows_from_the_end_without_a_relayout() -> None:
    mask = torch.ones(ROWS, WIDTH, dtype=torch.long)
    mask[3, :2] = 0  # left padding in one row only: nothing common to trim
    cache, keys = _filled_cache(mask)
    buffers = [layer._k.data_ptr() for layer in cache.layers]
    # rows 1 and 3 leave: row 4 takes place 1, rows 0 and 2 stay where they are
    cache, new_mask, order = kv_cache.select(cache, mask, [0, 2, 4])
    assert order == [0, 4, 2]
    torch.testing.assert_close(new_mask, mask[[0, 4, 2]], rtol=0, atol=0)
    for layer, k, ptr in zip(cache.layers, keys, buffers, strict=True):
        assert layer._k.data_ptr() == ptr  # the same buffer: only row 4 was copied
        torch.testing.assert_close(layer.keys, k[[0, 4, 2]], rtol=0, atol=0)
        torch.testing.assert_close(layer.values, k[[0, 4, 2]] + 100, rtol=0, atol=0)
    # the next decode step appends one position to each of the three rows
    for layer, k in zip(cache.layers, keys, strict=True):
        step = torch.randn(3, KV_HEADS, 1, HEAD_DIM)
        got_k, got_v = layer.update(step, step - 7)
        torch.testing.assert_close(got_k, torch.cat([k[[0, 4, 2]], step], 2), rtol=0, atol=0)
        torch.testing.assert_close(
            got_v, torch.cat([k[[0, 4, 2]] + 100, step - 7], 2), rtol=0, atol=0
        )


def test_leaving_rows_past_the_new_size_moves_nothing() -> None:
    mask = torch.ones(ROWS, WIDTH, dtype=torch.long)
    cache, keys = _filled_cache(mask)
    cache, new_mask, order = kv_cache.select(cache, mask, [0, 1, 2])
    assert order == [0, 1, 2] and new_mask.shape == (3, WIDTH)
    for layer, k in zip(cache.layers, keys, strict=True):
        torch.testing.assert_close(layer.keys, k[:3], rtol=0, atol=0)


def test_wide_common_padding_is_trimmed_in_row_order() -> None:
    mask = torch.ones(ROWS, WIDTH, dtype=torch.long)
    mask[[0, 2], :4] = 0  # the two kept rows share 4 of 6 positions of padding
    cache, keys = _filled_cache(mask)
    cache, new_mask, order = kv_cache.select(cache, mask, [0, 2])
    assert order == [0, 2]
    torch.testing.assert_close(new_mask, mask[[0, 2], 4:], rtol=0, atol=0)
    for layer, k in zip(cache.layers, keys, strict=True):
        torch.testing.assert_close(layer.keys, k[[0, 2], :, 4:], rtol=0, atol=0)
        torch.testing.assert_close(layer.values, k[[0, 2], :, 4:] + 100, rtol=0, atol=0)
