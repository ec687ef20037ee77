"""The running batch's KV cache: one left-padded row per sequence, rows join and leave.

Row ``i`` holds the keys/values of its sequence's first ``lens[i]`` tokens in
the *last* ``lens[i]`` columns of a ``(rows, heads, width, head_dim)`` tensor
per layer; the columns before are padding, masked out by :meth:`decode_mask`.
Joining rows are prefilled on their own and concatenated (the narrower side is
left-padded); leaving rows are index-selected out and all-padding leading
columns trimmed. So the per-token cost of a decode step is one forward pass of
one token per row — the past is never recomputed — and the copies happen only
when the batch's membership changes: each layer keeps spare columns after its
last one (:class:`GrowingLayer`), so a decode step writes its new column in place
instead of concatenating (copying) the whole cache as ``DynamicLayer`` does —
that copy made a decode step's cost grow with rows x width (77 % of a step at
128 rows x 300 columns).

Only full-attention decoder layers are supported (``DynamicLayer``), which
covers Llama/Qwen2/Qwen3/Mistral-style models without sliding windows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["BatchCache", "GrowingLayer"]

ROOM = 64
"""Spare columns a layer gets beyond its width (at least; doubled when full)."""


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose appends write into spare capacity (amortised O(new tokens)).

    ``keys`` / ``values`` are views of the first ``width`` columns of larger buffers;
    when an append does not fit, the buffers are reallocated with twice the room.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int = ROOM):
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._width = keys.shape[-2]
        self._kbuf = _with_room(keys, self._width + room)
        self._vbuf = _with_room(values, self._width + room)
        self._views()

    def _views(self) -> None:
        self.keys = self._kbuf[:, :, : self._width]
        self.values = self._vbuf[:, :, : self._width]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        w, n = self._width, key_states.shape[-2]
        if w + n > self._kbuf.shape[-2]:
            cap = max(2 * self._kbuf.shape[-2], w + n + ROOM)
            self._kbuf = _with_room(self.keys, cap)
            self._vbuf = _with_room(self.values, cap)
        self._kbuf[:, :, w : w + n] = key_states
        self._vbuf[:, :, w : w + n] = value_states
        self._width = w + n
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._width


def _with_room(t: torch.Tensor, capacity: int) -> torch.Tensor:
    """A (rows, heads, capacity, dim) buffer whose first columns hold ``t``."""
    rows, heads, width, dim = t.shape
    buf = t.new_empty(rows, heads, capacity, dim)
    buf[:, :, :width] = t
    return buf


def _growing(data: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A cache of :class:`GrowingLayer` holding ``data`` (one (keys, values) per layer)."""
    cache = DynamicCache()
    cache.layers = [GrowingLayer(k, v) for k, v in data]
    return cache


class BatchCache:
    """Per-sequence KV cache of the running batch (see module docstring)."""

    def __init__(self, cache: DynamicCache, lens: Sequence[int]):
        if not all(isinstance(layer, GrowingLayer) for layer in cache.layers):
            cache = _growing(_layers(cache))
        self.cache = cache
        self.lens = list(lens)

    @property
    def rows(self) -> int:
        return len(self.lens)

    @property
    def width(self) -> int:
        return self.cache.get_seq_length()

    def decode_mask(self, device: torch.device) -> torch.Tensor:
        """Attention mask (rows, width + 1) for one new token per row."""
        width = self.width + 1
        lens = torch.tensor(self.lens, device=device)[:, None] + 1
        return (torch.arange(width, device=device)[None, :] >= width - lens).long()

    def positions(self, device: torch.device) -> torch.Tensor:
        """Position id of each row's next token, (rows, 1)."""
        return torch.tensor(self.lens, device=device)[:, None]

    def advance(self) -> None:
        """Every row gained one token (after a decode step)."""
        self.lens = [n + 1 for n in self.lens]

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (non-empty, in that order); trim all-padding leading columns."""
        assert rows, "drop the whole BatchCache instead of keeping no rows"
        if list(rows) == list(range(self.rows)):
            return
        self.lens = [self.lens[i] for i in rows]
        start = self.width - max(self.lens)
        index = torch.tensor(list(rows), device=self.cache.layers[0].keys.device)
        data = [
            (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
            for k, v in _layers(self.cache)
        ]
        self.cache = _growing(data)

    def extend(self, other: BatchCache) -> None:
        """Append ``other``'s rows after this cache's rows."""
        width = max(self.width, other.width)
        data = [
            (_cat(k1, k2, width), _cat(v1, v2, width))
            for (k1, v1), (k2, v2) in zip(_layers(self.cache), _layers(other.cache), strict=True)
        ]
        self.cache = _growing(data)
        self.lens += other.lens


def _cat(a: torch.Tensor, b: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([_pad(a, width), _pad(b, width)])


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad the sequence dim (-2) of a (rows, heads, seq, dim) tensor to ``width``."""
    missing = width - t.shape[-2]
    if missing == 0:
        return t
    return torch.nn.functional.pad(t, (0, 0, missing, 0))
