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
import functools
import itertools
import math
from collections.abc import Mapping
from concurrent.futures import Executor

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
    scratches: list[torch.Tensor],
    guess: int,
    auto: bool,
    reuse: torch.Tensor | None = None,
    pool: Executor | None = None,
) -> tuple[torch.Tensor | None, int]:
    """Bring ``base`` (flat uint8, the bytes pushed last) to the bucket ``segs`` packs as
    ``dtype`` and return ``(payload, changed words)``, or ``(None, -1)`` when ``auto`` and
    the payload would not be smaller (the base then holds the whole bucket).

    ``scratches``: one chunk buffer per part (each a multiple of 8 bytes). With a ``pool``
    the bucket is cut into that many runs of whole chunks, each compared by its own thread
    (the first here, the others on ``pool``; the loops and copies release the GIL), each
    part's words into its own region of the payload, moved together at the end; ``auto``
    then sends the bucket whole as soon as one part would not be smaller. ``guess``: the
    changed words expected (sizes the payload); ``reuse``: a buffer the payload may be
    written into (its pages already mapped) when large enough."""
    item, chunk = dtype.itemsize, scratches[0].numel()
    assert chunk % 8 == 0 and chunk >= 8, chunk
    nbytes = segs.numel * item
    n = nbytes // 8
    limit = math.ceil(nbytes / 12) - 1 if auto else n  # auto: more and it goes whole
    chunks = math.ceil(nbytes / chunk)
    ways = 1 if pool is None else max(1, min(len(scratches), chunks))
    cuts = [min(nbytes, chunks * j // ways * chunk) for j in range(ways + 1)]
    spans = list(itertools.pairwise(cuts))
    caps = [min(limit, max(1024, guess * (b - a) // max(1, nbytes))) for a, b in spans]
    total = sum(caps)
    size = 12 * total + 8
    buf = reuse[:size] if reuse is not None and reuse.numel() >= size else None
    buf = torch.empty(size, dtype=torch.uint8) if buf is None else buf
    parts, at = [], 0
    for (a, b), cap in zip(spans, caps, strict=True):
        own = limit if ways == 1 else min(limit, math.ceil((b - a) / 12) - 1 if auto else n)
        vals = buf[8 * at : 8 * (at + cap)]
        parts.append(_Part(vals, buf[8 * total + 4 * at :][: 4 * cap], own, a, b))
        at += cap
    run = functools.partial(_compare, native, segs, dtype, base)
    jobs = list(zip(parts, scratches[:ways], strict=True))
    later = [pool.submit(run, *job) for job in jobs[1:]] if pool else []
    whole = [run(*jobs[0]), *(f.result() for f in later)]
    count = sum(p.count.value for p in parts)
    if any(whole) or (ways > 1 and count > limit):
        return None, -1
    return _joined(parts, buf, count, base[n * 8 :]), count


class _Part:
    """One part's payload being filled: values and indices (uint8 views, room for ``cap``);
    grown (copied into new buffers) when the guess was short, up to ``limit``; bucket bytes
    ``[lo, hi)``."""

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
    """The part's bytes (whole chunks, or up to the bucket's end) chunk by chunk into its
    payload and the base; True when it reached its limit of changed words first: the rest
    of the part is then packed straight into the base (the bucket goes whole)."""
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


def _joined(parts: list[_Part], buf: torch.Tensor, count: int, tail: torch.Tensor) -> torch.Tensor:
    """The payload: every part's values, then their indices, then the bucket's tail; moved
    together inside ``buf`` (each part's region lies at or after where its words go), or
    copied into a new buffer once a part grew out of its region or ``buf`` is short."""
    size = 12 * count + tail.numel()
    if any(p.grown for p in parts) or size > buf.numel():
        buf = torch.empty(size, dtype=torch.uint8)
    at = 0
    for p in parts:  # values first: the indices' regions lie behind every value's
        c = p.count.value
        ctypes.memmove(buf.data_ptr() + 8 * at, p.vals.data_ptr(), 8 * c)
        at += c
    at = 0
    for p in parts:
        c = p.count.value
        ctypes.memmove(buf.data_ptr() + 8 * count + 4 * at, p.idx.data_ptr(), 4 * c)
        at += c
    out = buf[:size]
    out[12 * count :].copy_(tail)
    return out
