"""A delta push's bucket packed and compared chunk by chunk (CPU buffers, compiled loops).

Packing a whole bucket into a scratch slot and then comparing the slot with the bucket's
base moves the bucket's bytes through memory twice: the cast writes them (1 GB of bf16 for
a 0.5B model) and the compare reads them back. Here the bucket is packed ``CHUNK_BYTES`` at
a time into a small scratch buffer (it stays in the core's L2 cache), by the same ``copy_``
the packer uses (so the same bytes, bit for bit), and each chunk is compared with its base
by the compiled ``encode`` loop (``delta_native``) at once: only the base is read from
memory, and only the changed words are written.

:func:`take_chunked` gives the same payload and leaves the same base as
``DeltaEncoder.take`` of the whole packed bucket (``tests/transports/weights/
test_delta_pack.py``). Its payload buffer is sized from the bucket's changed words at the
last push (the first time: an eighth of its words) and grown when short; ``auto`` sends the
bucket whole once the payload would not be smaller (the rest of the bucket is then packed
straight into the base).
"""

from __future__ import annotations

import bisect
import ctypes
import math
from collections.abc import Mapping

import torch

from asyncrl.transports.weights.delta_native import Kernels

__all__ = ["CHUNK_BYTES", "Segments", "take_chunked"]

CHUNK_BYTES = 1 << 19
"""Bytes packed and compared at a time (half the L2 cache of a core here)."""


class Segments:
    """A bucket's entries as flat source ranges: ``pack(dst, lo, hi)`` packs the bucket's
    elements ``[lo, hi)`` into ``dst`` exactly as ``bucket.pack_into`` packs them all."""

    def __init__(self, entries: list[tuple[str, int, int]], tensors: Mapping[str, torch.Tensor]):
        self.starts: list[int] = []  # bucket element offset of each entry
        self.srcs: list[torch.Tensor] = []
        offset = 0
        for name, start, numel in entries:
            src = tensors[name].reshape(-1)
            src = src[start : start + numel] if numel >= 0 else src
            self.starts.append(offset)
            self.srcs.append(src)
            offset += src.numel()
        self.numel = offset

    def pack(self, dst: torch.Tensor, lo: int, hi: int) -> None:
        """Elements ``[lo, hi)`` of the packed bucket into ``dst[: hi - lo]``."""
        j, at = bisect.bisect_right(self.starts, lo) - 1, lo
        while at < hi:
            start, src = self.starts[j], self.srcs[j]
            end = min(hi, start + src.numel())
            if end > at:
                dst[at - lo : end - lo].copy_(src[at - start : end - start])
            at, j = end, j + 1


def take_chunked(
    native: Kernels,
    segs: Segments,
    dtype: torch.dtype,
    base: torch.Tensor,
    scratch: torch.Tensor,
    guess: int,
    auto: bool,
    reuse: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, int]:
    """Bring ``base`` (flat uint8, the bytes pushed last) to the bucket ``segs`` packs as
    ``dtype`` and return ``(payload, changed words)``, or ``(None, -1)`` when ``auto`` and
    the payload would not be smaller (the base then holds the whole bucket). ``scratch``:
    the chunk buffer (a multiple of 8 bytes); ``guess``: the changed words expected (sizes
    the payload); ``reuse``: a buffer the payload may be written into (its pages already
    mapped) when large enough."""
    nbytes = segs.numel * dtype.itemsize
    n = nbytes // 8
    limit = math.ceil(nbytes / 12) - 1 if auto else n  # auto: more and it goes whole
    cap = min(limit, max(1024, guess))
    size = 12 * cap + 8
    buf = reuse[:size] if reuse is not None and reuse.numel() >= size else None
    buf = torch.empty(size, dtype=torch.uint8) if buf is None else buf
    part = _Part(buf[: 8 * cap], buf[8 * cap : 12 * cap], limit, 0, nbytes)
    if _compare(native, segs, dtype, base, part, scratch):
        return None, -1
    c = part.count.value
    out = buf if not part.grown else torch.empty(12 * c + 8, dtype=torch.uint8)
    ctypes.memmove(out.data_ptr(), part.vals.data_ptr(), 8 * c)  # no move unless it grew
    ctypes.memmove(out.data_ptr() + 8 * c, part.idx.data_ptr(), 4 * c)  # may overlap
    payload = out[: 12 * c + nbytes % 8]
    payload[12 * c :].copy_(base[n * 8 :])
    return payload, c


class _Part:
    """The payload being filled for bucket bytes ``[lo, hi)``: values and indices (uint8
    views, room for ``cap``); grown (copied into new buffers) when the guess was short, up
    to ``limit`` changed words."""

    def __init__(self, vals: torch.Tensor, idx: torch.Tensor, limit: int, lo: int, hi: int):
        self.vals, self.idx, self.limit, self.lo, self.hi = vals, idx, limit, lo, hi
        self.cap = vals.numel() // 8
        self.count = ctypes.c_int64(0)
        self.grown = False

    def grow(self) -> None:
        cap, c = min(self.limit, 2 * self.cap), self.count.value
        vals = torch.empty(8 * cap, dtype=torch.uint8)
        idx = torch.empty(4 * cap, dtype=torch.uint8)
        vals[: 8 * c].copy_(self.vals[: 8 * c])
        idx[: 4 * c].copy_(self.idx[: 4 * c])
        self.vals, self.idx, self.cap, self.grown = vals, idx, cap, True


def _compare(
    native: Kernels,
    segs: Segments,
    dtype: torch.dtype,
    base: torch.Tensor,
    part: _Part,
    scratch: torch.Tensor,
) -> bool:
    """The part's bytes chunk by chunk into its payload and the base; True when it reached
    its limit of changed words first: the rest is then packed straight into the base (the
    bucket goes whole)."""
    item, chunk, hi = dtype.itemsize, scratch.numel(), part.hi
    typed = scratch.view(dtype)
    for a in range(part.lo, hi, chunk):
        b = min(hi, a + chunk)
        segs.pack(typed, a // item, b // item)
        i, end = a // 8, b // 8
        new_at = scratch.data_ptr() - a  # so word i of the bucket is new_[i]
        while True:
            i = native.encode(
                new_at, base.data_ptr(), i, end, part.vals.data_ptr(), part.idx.data_ptr(),
                ctypes.byref(part.count), part.cap,
            )  # fmt: skip
            if i == end:
                break
            if part.cap >= part.limit:  # the rest of the part straight into the base: whole
                base[8 * i : b].copy_(scratch[8 * i - a : b - a])
                segs.pack(base.view(dtype)[b // item : hi // item], b // item, hi // item)
                return True
            part.grow()
        if b % 8:  # the bucket's last bytes (no whole word) into the base
            base[b - b % 8 : b].copy_(scratch[b - b % 8 - a : b - a])
    return False
