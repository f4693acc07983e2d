"""The running batch's KV cache: left-padded rows that requests join and leave.

Each layer keeps its keys and values in a buffer with spare room along the sequence axis, so
a decode step writes one position in place instead of concatenating the whole cache (what
transformers' ``DynamicLayer`` does, and what the static ``generate`` baseline pays at every
step). The layer is a ``DynamicLayer`` to transformers: ``keys``/``values`` are views of the
filled part.

Rows leave without a re-layout: a kept row from the end of the batch moves into each place
that frees up below the new batch size, so a leave copies the moved rows only, and the buffer
shrinks to a view of its first rows (:func:`select`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

_HEADROOM = 64  # positions of spare room after a (re)allocation, at least


class GrowingLayer(DynamicLayer):
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            return self.assign(key_states, value_states)
        assert self.keys is not None and self.values is not None  # initialized: assign set them
        filled, new = self.keys.shape[-2], key_states.shape[-2]
        if filled + new > self._k.shape[-2]:
            self.assign(self.keys, self.values, extra=new)
        self._k[:, :, filled : filled + new] = key_states
        self._v[:, :, filled : filled + new] = value_states
        keys, values = self._k[:, :, : filled + new], self._v[:, :, : filled + new]
        self.keys, self.values = keys, values
        return keys, values

    def assign(
        self, keys: torch.Tensor, values: torch.Tensor, extra: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replace the contents (copied into a fresh buffer with room to grow); returns the
        filled views, the layer's new ``keys`` and ``values``."""
        filled = keys.shape[-2]
        room = filled + extra + max(_HEADROOM, filled // 2)
        self._k = keys.new_empty(*keys.shape[:2], room, keys.shape[-1])
        self._v = values.new_empty(*values.shape[:2], room, values.shape[-1])
        self._k[:, :, :filled] = keys
        self._v[:, :, :filled] = values
        filled_keys, filled_values = self._k[:, :, :filled], self._v[:, :, :filled]
        self.keys, self.values = filled_keys, filled_values
        self.device, self.is_initialized = keys.device, True
        return filled_keys, filled_values

    @torch.inference_mode()  # the buffers are inference tensors; an abort moves rows outside
    def move_rows(self, dst: list[int], src: list[int], rows: int) -> None:
        """Copy rows ``src`` into rows ``dst`` and keep the first ``rows`` (a view, no copy)."""
        assert self.keys is not None and self.values is not None  # select: filled layers only
        filled = self.keys.shape[-2]
        if dst:
            self._k[dst, :, :filled] = self._k[src, :, :filled]
            self._v[dst, :, :filled] = self._v[src, :, :filled]
        self._k, self._v = self._k[:rows], self._v[:rows]
        self.keys, self.values = self._k[:, :, :filled], self._v[:, :, :filled]

    def to(self, device: torch.device | str) -> None:
        """Move the filled part (e.g. to host memory while the engine is offloaded)."""
        if self.is_initialized:
            assert self.keys is not None and self.values is not None  # assign set them
            self.assign(self.keys.to(device), self.values.to(device))


def new_cache(config: PretrainedConfig) -> DynamicCache:
    """A transformers cache whose full-attention layers grow in place."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(x) is DynamicLayer else x for x in cache.layers]
    return cache


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    pad = width - t.shape[dim]
    if pad == 0:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def merge(
    cache: DynamicCache | None, mask: torch.Tensor | None, new: DynamicCache, new_mask: torch.Tensor
) -> tuple[DynamicCache, torch.Tensor]:
    """Append prefilled rows to the batch, left-padding both to a common width."""
    if cache is None or mask is None:
        return new, new_mask
    width = max(mask.shape[1], new_mask.shape[1])
    for (layer, k, v), (_, jk, jv) in zip(_filled(cache), _filled(new), strict=True):
        keys = torch.cat([_left_pad(k, width, 2), _left_pad(jk, width, 2)])
        values = torch.cat([_left_pad(v, width, 2), _left_pad(jv, width, 2)])
        _assign(layer, keys, values)
    return cache, torch.cat([_left_pad(mask, width, 1), _left_pad(new_mask, width, 1)])


def select(
    cache: DynamicCache, mask: torch.Tensor, rows: list[int]
) -> tuple[DynamicCache, torch.Tensor, list[int]]:
    """Keep ``rows`` (ascending) of the batch; returns the cache, the mask and, for each row of
    the new batch, the old row it holds.

    A kept row below the new batch size stays in place and each freed place there takes a kept
    row from above it, so only the moved rows' keys and values are copied (rows change order).
    When the kept rows' common left padding is more than half the width, or a layer cannot
    move rows in place, the cache is laid out again in row order without that padding."""
    n, index = len(rows), torch.tensor(rows)
    kept = mask[index]
    lead = int((kept.cumsum(1) == 0).sum(1).min())
    filled = list(_filled(cache))
    growing = [layer for layer, _, _ in filled if isinstance(layer, GrowingLayer)]
    if 2 * lead > mask.shape[1] or len(growing) < len(filled):
        for layer, keys, values in filled:
            _assign(layer, keys[index, :, lead:], values[index, :, lead:])
        return cache, kept[:, lead:], list(rows)
    holes = sorted(set(range(n)) - set(rows))
    movers = [r for r in rows if r >= n]
    order = list(range(n))
    for hole, mover in zip(holes, movers, strict=True):
        order[hole] = mover
    for layer in growing:
        layer.move_rows(holes, movers, n)
    return cache, mask[torch.tensor(order)], order


def expand(
    cache: DynamicCache, mask: torch.Tensor, index: torch.Tensor
) -> tuple[DynamicCache, torch.Tensor]:
    """Rows ``index`` of the batch (repeats allowed: requests sharing a prefilled prompt)."""
    for layer, keys, values in _filled(cache):
        _assign(layer, keys[index], values[index])
    return cache, mask[index]


def nbytes(cache: DynamicCache) -> int:
    """Allocated bytes behind the cache (each layer's buffers, spare room included, once)."""
    storages: dict[int, int] = {}
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor) and t.numel():
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def move(cache: DynamicCache, device: torch.device | str) -> None:
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.to(device)
        else:
            assert isinstance(layer, CacheLayerMixin)  # attention layers only, as in _filled
            if layer.is_initialized:
                assert layer.keys is not None and layer.values is not None
                layer.keys, layer.values = layer.keys.to(device), layer.values.to(device)


def _filled(cache: DynamicCache) -> Iterator[tuple[CacheLayerMixin, torch.Tensor, torch.Tensor]]:
    """Each layer with its keys and values: the engine's models (``FastForward.supports`` or
    the HF forward over full attention) fill every layer of a cache they ran over."""
    for layer in cache.layers:
        assert isinstance(layer, CacheLayerMixin), type(layer)
        assert layer.keys is not None and layer.values is not None, "an unfilled cache layer"
        yield layer, layer.keys, layer.values


def _assign(layer: CacheLayerMixin, keys: torch.Tensor, values: torch.Tensor) -> None:
    if isinstance(layer, GrowingLayer):
        layer.assign(keys, values)
    else:
        layer.keys, layer.values = keys, values
