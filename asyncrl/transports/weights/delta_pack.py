"""A delta push's bucket packed and compared chunk by chunk (CPU buffers, compiled loops).

Packing a whole bucket into a scratch slot and then comparing the slot with the bucket's
base moves the bucket's bytes through memory twice: the cast writes them (1 GB of bf16 for
a 0.5B model) and the compare reads them back. Here the bucket is packed ``CHUNK_BYTES`` at
a time into a small scratch buffer (it stays in the core's L2 cache), by the same ``copy_``
the packer uses (so the same bytes, bit for bit), and each chunk is compared with its base
by the compiled ``encode`` loop (``delta_native``) at once: only the base is read from
memory, and only the changed words are written. When the bucket's entries are contiguous
fp32 tensors synced as bf16 they are not packed at all: the compiled ``encode_bf16`` reads
the fp32 values, casts them exactly as torch's ``copy_`` does (:func:`bf16_nan`) and
compares them with the base in the same pass; only a word shared by two entries is packed
by torch first.

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
import logging
import math
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from asyncrl.transports.weights.delta_native import Kernels

__all__ = ["CHUNK_BYTES", "Segments", "bf16_nan", "take_chunked"]

log = logging.getLogger("asyncrl.weights")

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

    def fp32(self) -> bool:
        """Every entry a contiguous fp32 CPU tensor (the fused cast reads them in place)."""
        return all(
            s.dtype == torch.float32 and s.device.type == "cpu" and s.layout == torch.strided
            and s.is_contiguous() and not s.is_neg()
            for s in self.srcs
        )  # fmt: skip


def take_chunked(
    native: Kernels,
    segs: Segments,
    dtype: torch.dtype,
    base: torch.Tensor,
    scratch: torch.Tensor,
    guess: int,
    auto: bool,
    reuse: torch.Tensor | None = None,
    fused: bool = True,
) -> tuple[torch.Tensor | None, int]:
    """Bring ``base`` (flat uint8, the bytes pushed last) to the bucket ``segs`` packs as
    ``dtype`` and return ``(payload, changed words)``, or ``(None, -1)`` when ``auto`` and
    the payload would not be smaller (the base then holds the whole bucket). ``scratch``:
    the chunk buffer (a multiple of 8 bytes); ``guess``: the changed words expected (sizes
    the payload); ``reuse``: a buffer the payload may be written into (its pages already
    mapped) when large enough; ``fused``: fp32 entries packed as bf16 are cast while
    compared, in one compiled pass (:func:`bf16_nan`), when the compiled cast agrees with
    torch's."""
    nbytes = segs.numel * dtype.itemsize
    n = nbytes // 8
    limit = math.ceil(nbytes / 12) - 1 if auto else n  # auto: more and it goes whole
    cap = min(limit, max(1024, guess))
    size = 12 * cap + 8
    buf = reuse[:size] if reuse is not None and reuse.numel() >= size else None
    buf = torch.empty(size, dtype=torch.uint8) if buf is None else buf
    part = _Part(buf[: 8 * cap], buf[8 * cap : 12 * cap], limit, 0, nbytes)
    nan = bf16_nan(native) if fused and dtype == torch.bfloat16 and segs.fp32() else None
    if nan is not None:
        whole = _compare_fused(native, segs, base, part, nan, scratch)
    else:
        whole = _compare(native, segs, dtype, base, part, scratch)
    if whole:
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
        new_at = scratch.data_ptr() - a  # so word i of the bucket is new_[i]
        i = _encode(native.encode, new_at, base, a // 8, b // 8, part)
        if i != b // 8:  # the rest of the part straight into the base: whole
            base[8 * i : b].copy_(scratch[8 * i - a : b - a])
            segs.pack(base.view(dtype)[b // item : hi // item], b // item, hi // item)
            return True
        if b % 8:  # the bucket's last bytes (no whole word) into the base
            base[b - b % 8 : b].copy_(scratch[b - b % 8 - a : b - a])
    return False


def _encode(
    fn: Any, new_at: int, base: torch.Tensor, i: int, end: int, part: _Part, *extra: Any
) -> int:
    """Words ``[i, end)`` through the compiled loop ``fn`` (``new_at``: the address word 0 of
    the bucket would have), the payload grown when full; returns ``end``, or the word it
    stopped at when the part reached its limit of changed words."""
    while True:
        i = fn(
            new_at, base.data_ptr(), i, end, part.vals.data_ptr(), part.idx.data_ptr(),
            ctypes.byref(part.count), part.cap, *extra,
        )  # fmt: skip
        if i == end or part.cap >= part.limit:
            return i
        part.grow()


def _compare_fused(
    native: Kernels, segs: Segments, base: torch.Tensor, part: _Part, nan: int, word: torch.Tensor
) -> bool:
    """:func:`_compare` of fp32 entries packed as bf16 without packing them: the words that
    lie inside one entry are cast from it while compared (``encode_bf16``), a word shared by
    two entries is packed into ``word`` (8 bytes at least) first; True when the part reached
    its limit of changed words (the rest is then packed straight into the base)."""
    n, w = segs.numel // 4, 0  # whole words; the next word to compare
    for start, src in zip(segs.starts, segs.srcs, strict=True):
        first = min(n, -(-start // 4))  # the entry's first and last whole word
        last = max(first, min(n, (start + src.numel()) // 4))
        if _packed_words(native, segs, base, part, w, first, word):
            return True
        w = max(w, first)
        if last > w:
            i = _encode(native.encode_bf16, src.data_ptr() - 4 * start, base, w, last, part, nan)
            if i != last:
                segs.pack(base.view(torch.bfloat16)[4 * i :], 4 * i, segs.numel)
                return True
            w = last
    if _packed_words(native, segs, base, part, w, n, word):
        return True
    if segs.numel % 4:  # the bucket's last elements (no whole word) into the base
        segs.pack(base.view(torch.bfloat16)[4 * n :], 4 * n, segs.numel)
    return False


def _packed_words(
    native: Kernels,
    segs: Segments,
    base: torch.Tensor,
    part: _Part,
    w: int,
    end: int,
    word: torch.Tensor,
) -> bool:
    """Words ``[w, end)`` packed one at a time into ``word`` and compared; True when the
    part reached its limit (the rest of the bucket then packed straight into the base)."""
    for j in range(w, end):
        segs.pack(word.view(torch.bfloat16), 4 * j, 4 * j + 4)
        if _encode(native.encode, word.data_ptr() - 8 * j, base, j, j + 1, part) != j + 1:
            segs.pack(base.view(torch.bfloat16)[4 * j :], 4 * j, segs.numel)
            return True
    return False


_PROBE = [0x0, 0x80000000, 0x1, 0x80000001, 0x7FFF, 0x8000, 0x8001, 0x18000, 0x7FFFFF]
_PROBE += [0x807FFFFF, 0x800000, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7FFFFF]
_PROBE += [0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x7F800000, 0xFF800000, 0x7F800001, 0x7FC00000]
_PROBE += [0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FBFFFFF, 0xFF800001]
"""fp32 bit patterns the compiled cast is checked on against torch's: zeros, subnormals and
their ties, rounding ties to even and odd, the largest finite values (rounding to inf),
infinities, NaNs of each sign with various payloads."""

_nans: weakref.WeakKeyDictionary[Kernels, int | None] = weakref.WeakKeyDictionary()


def bf16_nan(native: Kernels) -> int | None:
    """The bf16 bits torch's CPU cast (``copy_`` into a bf16 tensor, as the packer does)
    gives every NaN — 0xffff from its vectorised kernels, 0x7fc0 from the scalar
    ``round_to_nearest_even`` in c10/util/BFloat16.h — when the compiled cast with it
    gives torch's bits on :data:`_PROBE` and 4096 random patterns (each NaN the same, each
    other value rounded to nearest even on its bits); else None: the fused cast is not used
    and the bucket is packed by torch chunk by chunk."""
    if native not in _nans:
        _nans[native] = _probe(native)
    return _nans[native]


def _probe(native: Kernels) -> int | None:
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(0, 1 << 32, (4096,), generator=g, dtype=torch.int64)
    bits = torch.cat(
        [torch.tensor(_PROBE), rand, torch.tensor(_PROBE), torch.tensor([0x3F800000] * 4)]
    )
    src = bits.to(torch.int32).view(torch.float32)  # wraps: the low 32 bits, as patterns
    want = torch.empty(src.numel(), dtype=torch.bfloat16)
    want.copy_(src)
    nan = int(want[len(_PROBE) - 6].view(torch.int16)) & 0xFFFF  # 0x7fc00000's
    base = torch.zeros(src.numel() * 2, dtype=torch.uint8)
    n = src.numel() // 4
    vals, idx = torch.empty(8 * n, dtype=torch.uint8), torch.empty(4 * n, dtype=torch.uint8)
    count = ctypes.c_int64(0)
    args = (base.data_ptr(), 0, n, vals.data_ptr(), idx.data_ptr(), ctypes.byref(count), n, nan)
    if native.encode_bf16(src.data_ptr(), *args) != n or not torch.equal(
        base, want.view(torch.uint8)
    ):
        log.info("delta pushes: torch's bf16 cast is not the compiled one; packing by torch")
        return None
    return nan
