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
    the chunk (its size a multiple of 8 bytes); ``guess``: the changed words expected (the
    payload's first size); ``reuse``: a buffer the payload may be written into (its pages
    already mapped) when large enough."""
    item, chunk = dtype.itemsize, scratch.numel()
    assert chunk % 8 == 0 and chunk >= 8, chunk
    nbytes = segs.numel * item
    n, tail = nbytes // 8, nbytes % 8
    limit = math.ceil(nbytes / 12) - 1 if auto else n  # auto: more and it goes whole
    out = _Payload(min(limit, max(4096, guess)), tail, reuse)
    typed = scratch.view(dtype)
    for a in range(0, nbytes, chunk):
        b = min(nbytes, a + chunk)
        segs.pack(typed, a // item, b // item)
        i, end = a // 8, b // 8
        new_at = scratch.data_ptr() - a  # so word i of the bucket is new_[i]
        while True:
            i = native.encode(
                new_at, base.data_ptr(), i, end, out.ptr(0), out.ptr(8 * out.cap),
                ctypes.byref(out.count), out.cap,
            )  # fmt: skip
            if i == end:
                break
            if out.cap >= limit:  # the rest of the bucket straight into the base: whole
                base[8 * i : b].copy_(scratch[8 * i - a : b - a])
                segs.pack(base.view(dtype)[b // item :], b // item, segs.numel)
                return None, -1
            out.grow(min(limit, 2 * out.cap))
        if b == nbytes and tail:
            base[nbytes - tail :].copy_(scratch[nbytes - tail - a : b - a])
            out.buf[12 * out.cap :].copy_(scratch[nbytes - tail - a : b - a])
    return out.finish(), out.count.value


class _Payload:
    """A payload being filled: values at the front, indices behind room for ``cap`` values,
    the bucket's tail at the end; ``finish`` moves the indices down behind the values."""

    def __init__(self, cap: int, tail: int, reuse: torch.Tensor | None = None):
        self.cap, self.tail = cap, tail
        size = 12 * cap + tail
        if reuse is not None and reuse.numel() >= size:
            self.buf = reuse[:size]
        else:
            self.buf = torch.empty(size, dtype=torch.uint8)
        self.count = ctypes.c_int64(0)

    def ptr(self, offset: int) -> int:
        return self.buf.data_ptr() + offset

    def grow(self, cap: int) -> None:
        """Room for ``cap`` values, keeping those found (the estimate was short)."""
        grown = torch.empty(12 * cap + self.tail, dtype=torch.uint8)
        c = self.count.value
        grown[: 8 * c].copy_(self.buf[: 8 * c])
        grown[8 * cap : 8 * cap + 4 * c].copy_(self.buf[8 * self.cap : 8 * self.cap + 4 * c])
        self.buf, self.cap = grown, cap

    def finish(self) -> torch.Tensor:
        c, tail = self.count.value, self.tail
        ctypes.memmove(self.ptr(8 * c), self.ptr(8 * self.cap), 4 * c)  # may overlap
        out = self.buf[: 12 * c + tail]
        if tail and c < self.cap:
            out[12 * c :].copy_(self.buf[12 * self.cap :])
        return out
