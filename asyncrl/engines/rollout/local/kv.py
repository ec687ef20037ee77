"""The running batch's KV cache: one left-padded row per sequence, rows join and leave.

Row ``i`` holds the keys/values of its sequence's first ``lens[i]`` tokens in
the *last* ``lens[i]`` columns of a ``(rows, heads, width, head_dim)`` window
per layer; the columns before are padding (zeros or finite leftovers), masked
out by :meth:`BatchCache.decode_mask`. So the per-token cost of a decode step is
one forward pass of one token per row — the past is never recomputed.

The window lives in a larger buffer with spare rows and columns
(:class:`GrowingLayer`), so no operation copies the whole cache except a
reallocation when it is full (capacity doubles: amortised O(1) per token).
Capacity is sized to need: a new buffer gets ``ROOM`` spare columns and as
many spare rows as it has rows (at most ``max_rows`` rows, the engine's batch
limit, and ``max_width`` columns, its context length), so one long prompt costs
at most about twice its own keys/values:

- a decode step writes its new column in place (``DynamicLayer`` concatenates,
  i.e. copies the whole cache every step: 77 % of a step at 128 rows x 300
  columns, ~4x slower); when the window reaches the buffer's right end it is
  moved back to column 0 of the same buffers if at least ``ROOM`` columns stay
  free (trimming keeps sliding it right), else the buffers grow;
- joining rows (prefilled on their own) are written into spare rows,
  right-aligned; a wider joiner widens the window to the left when there is room;
- leaving rows are filled by moving the last rows into their places (one row
  copied per leaver — only the columns it has written — all of them in one indexed
  copy per buffer; the batch order changes: :meth:`BatchCache.drop` returns it),
  and all-padding leading columns are trimmed by moving the window start;
- a batch that empties hands its buffers to the next one (``spare``), which
  keeps them when they fit (the same limits as a reallocation), so a workload
  whose batches drain and refill (short answers: every step's batch empties)
  allocates nothing per batch.

Padding is zeroed lazily. Buffers are allocated uninitialised, and a joiner's or a
widened row's padding columns keep whatever the buffer held (a leftover, or NaN in a
fresh buffer). Each row counts its *clean* trailing columns (``BatchCache.clean``: its
keys/values, its prefill's own padding, or zeros); before a decode step reads the
last ``n`` columns of some rows, :meth:`BatchCache.clean_for` zeroes the part of those
columns that is not clean yet (attention masks padding, but ``0 x NaN`` is NaN).
Decode attention reads each row at its bucket's width
(:mod:`~asyncrl.engines.rollout.local.attention`), a short row beside a long one only
its own columns, so most padding is never zeroed at all: a batch of 160 short joiners
beside a 512-token row wrote ~80 MB of zeros per join when the padding was zeroed
eagerly. Nothing reads outside the window.

Only full-attention decoder layers are supported (``DynamicLayer``), which
covers Llama/Qwen2/Qwen3/Mistral-style models without sliding windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["BatchCache", "GrowingLayer"]

ROOM = 64
"""Spare columns (and at least as many spare rows) a buffer gets when (re)allocated."""


class GrowingLayer(DynamicLayer):
    """One layer's keys/values: a window ``[:rows, :, start:end]`` of larger buffers.

    ``keys`` / ``values`` are views of the window (what attention reads). Appends
    write in place; buffers are reallocated (window copied to the left edge) only
    when they run out of rows or columns.
    """

    # set from construction on (DynamicLayer's are None until its first update)
    keys: torch.Tensor
    values: torch.Tensor

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        max_rows: int | None = None,
        max_width: int | None = None,
        spare: GrowingLayer | None = None,
    ):
        """``spare``: a layer of an emptied batch whose buffers this one takes when they
        fit (:meth:`fits`); the caller checked."""
        super().__init__()
        self.max_rows, self.max_width = max_rows or 1 << 62, max_width or 1 << 62
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._kbuf = self._vbuf = keys[:0, :, :0]  # no capacity yet: _realloc sizes them
        self.keys, self.values = keys, values
        self._rows, self._start, self._end = keys.shape[0], 0, keys.shape[-2]
        if spare is None:
            self._realloc(keys.shape[0], keys.shape[-2], fresh=True)
            return
        self._kbuf, self._vbuf = spare._kbuf, spare._vbuf
        self._kbuf[: self._rows, :, : self._end] = keys
        self._vbuf[: self._rows, :, : self._end] = values
        self._views()

    def _row_capacity(self, rows: int) -> int:
        """Rows a buffer for ``rows`` rows gets: the current capacity while it holds them
        and is at most four times what they want (spare rows cost every reallocation),
        else twice ``rows`` (at most ``max_rows``)."""
        rcap = self._kbuf.shape[0]
        want = max(rows, min(2 * rows, self.max_rows))
        return rcap if rows <= rcap and rcap <= 4 * want else want

    def fits(self, keys: torch.Tensor) -> bool:
        """Whether a new batch's prefilled ``keys`` can take this (emptied) layer's buffers:
        the same dtype, device, heads and head size; room for its rows and columns but not
        over four times the columns a fresh buffer would get (``ROOM`` spare, at most
        ``max_width``: a narrow batch does not keep a long prompt's memory). Spare rows are
        kept: a batch that starts with one group grows to the size of the last one, which
        a fresh buffer would reach by reallocations. (Fewer spare columns than a fresh
        buffer's cost at most one reallocation later, which a fresh buffer costs now.)"""
        rows, heads, width, dim = keys.shape
        rcap, bheads, wcap, bdim = self._kbuf.shape
        same = (keys.dtype, keys.device, heads, dim) == (self.dtype, self.device, bheads, bdim)
        fresh = max(width, min(width + ROOM, self.max_width))
        return same and rows <= rcap and width <= wcap <= 4 * fresh

    @property
    def width(self) -> int:
        return self._end - self._start

    def _views(self) -> None:
        self.keys = self._kbuf[: self._rows, :, self._start : self._end]
        self.values = self._vbuf[: self._rows, :, self._start : self._end]

    def _realloc(self, rows: int, width: int, left: int = 0, fresh: bool = False) -> None:
        """Buffers for at least ``rows`` x ``width`` (capacity doubles, up to ``max_rows`` x
        ``max_width``; a ``fresh`` buffer gets ``ROOM`` spare columns); the window is copied
        to columns ``[left, left + width)``. New room is uninitialised (see the module
        docstring). Row capacity also shrinks back when it is over four times what ``rows``
        needs (a wave of joiners has left): spare rows would cost every later reallocation."""
        rcap, wcap = self._row_capacity(rows), self._kbuf.shape[-2]
        if width > wcap:
            grown = width + ROOM if fresh else max(2 * width, width + ROOM)
            wcap = max(width, min(grown, self.max_width))
        _, heads, w, dim = self.keys.shape
        kbuf = self.keys.new_empty(rcap, heads, wcap, dim)
        vbuf = self.values.new_empty(rcap, heads, wcap, dim)
        kbuf[: self._rows, :, left : left + w] = self.keys
        vbuf[: self._rows, :, left : left + w] = self.values
        self._kbuf, self._vbuf = kbuf, vbuf
        self._start, self._end = left, left + w
        self._views()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states.shape[-2]`` columns to every row (the model's cache write)."""
        n = key_states.shape[-2]
        if self._end + n > self._kbuf.shape[-2]:
            if self.width + n + ROOM <= self._kbuf.shape[-2]:
                self._shift_left()
            else:
                self._realloc(self._rows, self.width + n + ROOM)
        self._kbuf[: self._rows, :, self._end : self._end + n] = key_states
        self._vbuf[: self._rows, :, self._end : self._end + n] = value_states
        self._end += n
        self._views()
        return self.keys, self.values

    def _shift_left(self) -> None:
        """Move the window to column 0 of the same buffers (trimming slides it right as rows
        leave): copies only the window's rows and columns, where a reallocation would zero
        and copy whole new buffers (their spare rows included) each time it reaches the end."""
        w = self.width
        for buf in (self._kbuf, self._vbuf):
            win = buf[: self._rows, :, self._start : self._end]
            buf[: self._rows, :, :w] = win if self._start >= w else win.clone()
        self._start, self._end = 0, w
        self._views()

    def get_seq_length(self) -> int:
        return self.width

    def add_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append rows whose ``keys.shape[-2]`` columns end at the window's right edge."""
        m, w2 = keys.shape[0], keys.shape[-2]
        widen = max(0, w2 - self.width)
        if self._rows + m > self._kbuf.shape[0] or widen > self._start:
            self._realloc(self._rows + m, self.width + widen, left=widen)
        # the window grows to the left (the old rows' new columns are padding, not zeroed:
        # see the module docstring); the new rows' padding is not zeroed either
        self._start -= widen
        new = slice(self._rows, self._rows + m)
        self._kbuf[new, :, self._end - w2 : self._end] = keys
        self._vbuf[new, :, self._end - w2 : self._end] = values
        self._rows += m
        self._views()

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, cols: int) -> None:
        """The last ``cols`` columns of rows ``dst`` of the window become those of rows
        ``src`` (disjoint index sets)."""
        for buf in (self._kbuf, self._vbuf):
            win = buf[: self._rows, :, self._end - cols : self._end]
            win[dst] = win[src]

    def zero(self, row: slice, cols: slice) -> None:
        """Zero window columns ``cols`` of rows ``row``."""
        for buf in (self._kbuf, self._vbuf):
            buf[row, :, self._start : self._end][:, :, cols] = 0

    def permute_rows(self, index: torch.Tensor) -> None:
        """Row ``i`` becomes old row ``index[i]`` (one copy of the window)."""
        for buf in (self._kbuf, self._vbuf):
            win = buf[: self._rows, :, self._start : self._end]
            win.copy_(win.index_select(0, index))

    def narrow(self, rows: int, trim: int) -> None:
        """Keep the first ``rows`` rows; drop ``trim`` leading columns of the window."""
        self._rows = rows
        self._start += trim
        self._views()


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values of every layer of a prefilled cache: full-attention ``DynamicLayer`` s
    (the only kind this module supports), each filled, so neither is None."""
    layers = cast("list[DynamicLayer]", cache.layers)
    return [(cast(torch.Tensor, la.keys), cast(torch.Tensor, la.values)) for la in layers]


class BatchCache:
    """Per-sequence KV cache of the running batch (see module docstring)."""

    cache: DynamicCache  # of GrowingLayer s

    def __init__(
        self,
        cache: DynamicCache,
        lens: Sequence[int],
        max_rows: int | None = None,
        max_width: int | None = None,
        spare: BatchCache | None = None,
    ):
        """``max_rows`` / ``max_width``: the most rows and columns the cache will ever need
        (capacity never grows beyond them). ``spare``: an emptied batch's cache whose buffers
        this one takes where they fit (it must not be used afterwards)."""
        if not all(isinstance(layer, GrowingLayer) for layer in cache.layers):
            kv = _layers(cache)
            old: list[GrowingLayer | None] = [None] * len(kv)
            if spare is not None and len(spare._glayers) == len(kv):
                old = [g if g.fits(k) else None for g, (k, _) in zip(spare._glayers, kv)]  # noqa: B905
                spare.cache.layers = []  # the buffers that do not fit go before any allocation
            grown = DynamicCache()
            grown.layers = [
                GrowingLayer(k, v, max_rows, max_width, g)
                for (k, v), g in zip(kv, old, strict=True)
            ]
            cache = grown
        self.cache = cache
        self.lens = list(lens)
        # per row: its trailing window columns that are its keys/values, its prefill's own
        # padding (finite) or zeros — the columns a read may cover without zeroing first
        self.clean = [self.width] * len(self.lens)
        # decode_bias's buffer: (rows, spare columns) for this row set, the width it was
        # built at; None after a join, leave or sort (advance alone keeps it: see there)
        self._bias: tuple[torch.Tensor, int] | None = None

    @property
    def _glayers(self) -> list[GrowingLayer]:
        return cast("list[GrowingLayer]", self.cache.layers)  # GrowingLayer by construction

    @property
    def rows(self) -> int:
        return len(self.lens)

    @property
    def width(self) -> int:
        return self.cache.get_seq_length()

    def decode_mask(self, device: torch.device, sdpa: bool = False) -> torch.Tensor:
        """Attention mask for one new token per row: the 2D padding mask ``(rows, width + 1)``
        (1: attend), or with ``sdpa`` already in SDPA's 4D boolean form ``(rows, 1, 1,
        width + 1)`` (True: attend), which transformers hands to attention as it is —
        expanding the 2D mask costs more per step than the attention itself at small batches."""
        width = self.width
        first = torch.tensor([width - n for n in self.lens], device=device)
        attend = torch.arange(width + 1, device=device) >= first[:, None]
        return attend[:, None, None, :] if sdpa else attend.long()

    def decode_bias(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`decode_mask` as an additive mask ``(rows, width + 1)``: 0 where a row
        attends, -inf on its padding.

        Built once per row set: a decode step adds a column every row attends (its padding
        columns stay where they are), so the next step's mask is a view one column wider
        of the same buffer, whose ``ROOM`` spare columns are zeros (a join, leave or sort
        builds it anew)."""
        width, cached = self.width, self._bias
        if cached is not None:
            buf, built = cached
            if buf.device == device and buf.dtype == dtype and built <= width < buf.shape[1]:
                return buf[:, : width + 1]
        first = torch.tensor([width - n for n in self.lens], device=device)
        pad = torch.arange(width + 1 + ROOM, device=device) < first[:, None]
        buf = torch.zeros(pad.shape, dtype=dtype, device=device).masked_fill_(pad, -torch.inf)
        self._bias = buf, width
        return buf[:, : width + 1]

    @property
    def layers(self) -> list[GrowingLayer]:
        """Every layer's keys/values (what a decode step appends to)."""
        return self._glayers

    def positions(self, device: torch.device) -> torch.Tensor:
        """Position id of each row's next token, (rows, 1)."""
        return torch.tensor(self.lens, device=device)[:, None]

    def advance(self) -> None:
        """Every row gained one token (after a decode step)."""
        self.lens = [n + 1 for n in self.lens]
        self.clean = [n + 1 for n in self.clean]

    def clean_for(self, buckets: Sequence[tuple[int, int, int]]) -> None:
        """Before a decode step that reads, for each ``(first_row, end_row, n)``, the last
        ``n`` columns of those rows after its write (the window plus the new column): zero
        the columns of them that are not clean yet (adjacent, equally clean rows — one
        join's — in one write per layer)."""
        width, clean = self.width, self.clean
        for a, b, n in buckets:
            i = a
            while i < b:
                c = clean[i]
                if c + 1 >= n:
                    i += 1
                    continue
                j = i + 1
                while j < b and clean[j] == c:
                    j += 1
                cols = slice(width + 1 - n, width - c)  # window columns, before the write
                for layer in self._glayers:
                    layer.zero(slice(i, j), cols)
                clean[i:j] = [n - 1] * (j - i)
                i = j

    def drop(self, rows: Sequence[int]) -> list[int]:
        """Remove ``rows`` (not all of them); returns the new row order as old row indices.

        Each removed row's place is taken by the current last row (one row copied per
        removed row, not the whole cache); all-padding leading columns are trimmed.
        """
        order = list(range(self.rows))
        gone = sorted(set(rows), reverse=True)
        assert len(gone) < len(order), "drop the whole BatchCache instead of every row"
        for i in gone:  # descending: every row after i that was to go is gone already
            order[i] = order[-1]
            order.pop()
        # every moved row comes from past the new end into a hole before it: one copy each
        moved = [(i, j) for i, j in enumerate(order) if i != j]
        if moved:  # only the moved rows' clean columns: the rest is padding to them
            device = self._glayers[0].device
            dst = torch.tensor([i for i, _ in moved], device=device)
            src = torch.tensor([j for _, j in moved], device=device)
            cols = min(self.width, max(self.clean[j] for _, j in moved))  # >= each one's
            for layer in self._glayers:
                layer.move_rows(src, dst, cols)
        self.lens = [self.lens[j] for j in order]
        self.clean = [self.clean[j] for j in order]
        self._bias = None
        trim = self.width - max(self.lens)
        for layer in self._glayers:
            layer.narrow(len(order), trim)
        return order

    def sort(self) -> list[int]:
        """Reorder the rows longest first (what bucketed decode attention wants); returns
        the new order as old row indices."""
        order = sorted(range(self.rows), key=lambda i: -self.lens[i])
        index = torch.tensor(order, device=self._glayers[0].device)
        for layer in self._glayers:
            layer.permute_rows(index)
        self.lens = [self.lens[i] for i in order]
        self.clean = [self.clean[i] for i in order]
        self._bias = None
        return order

    def extend(self, cache: DynamicCache, lens: Sequence[int]) -> None:
        """Append the rows of ``cache`` (right-aligned, lengths ``lens``) after this cache's."""
        kv = _layers(cache)
        for layer, (k, v) in zip(self._glayers, kv, strict=True):
            layer.add_rows(k, v)
        self.lens += list(lens)
        self._bias = None
        self.clean += [kv[0][0].shape[-2]] * len(lens)  # their prefill's window

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers (keys and values, spare rows and columns included)."""
        return sum(2 * layer._kbuf.nbytes for layer in self._glayers)
