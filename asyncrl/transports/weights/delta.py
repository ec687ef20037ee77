"""Delta pushes (``weights.delta``): only the 8-byte words whose bits changed travel.

Encoding of one bucket against the bytes the engine holds from the previous
push (the *base*): the bucket's bytes are read as 8-byte words; the payload is

    [changed words, int64 x c][their word indices, int32 x c][the bucket's last nbytes % 8 bytes]

so it is ``12 c + nbytes % 8`` bytes against ``nbytes`` for the whole bucket;
a bucket never exceeds 2**31 words (``bucket_mb`` <= 16 GiB). Comparing and
applying words is bitwise (NaN payloads, signed zeros survive) and costs one
vectorised compare where an element-wise encoding would need a cast per dtype;
a bf16 word holds 4 elements, so the word fraction that changes is at most 4x
the element fraction (measured in ``asyncrl bench weight-sync --delta``).

Sender (:class:`DeltaEncoder`): keeps, per bucket, the bytes it pushed last in
the sync dtype on the trainer's device (the *bases*: one copy of the synced
weights), and little else: a push that sends no deltas packs each bucket
straight into its base and sends it from there; a delta push packs each bucket
into one scratch slot, compares it with the base and brings the base up to date
(the changed words written into it, or the whole bucket copied when it goes
whole, then sent from the base), so the slot is free for the next bucket at
once. ``auto`` first compares every 61st word and sends the bucket whole when
the estimate says the payload would not be smaller; otherwise it compares all
words and still sends it whole when the payload is not smaller.

On CPU buffers the compare and the apply are compiled C loops (``delta_native``: one
pass each, no branch on the data, no mask, no index arrays), and a delta push does not pack
the bucket whole at all: :meth:`DeltaEncoder.take_chunked` casts fp32 entries synced as
bf16 while comparing them, in one pass (``encode_bf16``; the bf16 bucket is never written
out), and packs any other bucket a cache-sized chunk at a time, comparing each chunk at
once (``delta_pack``; no scratch slot); its payload is sized from the bucket's last push,
grown when short, and kept for the next push when small. Without a C compiler the
torch/numpy path gives the same payloads, bit for bit, more slowly.

Engine (``delta_apply.DeltaApplier``): knows which version of bucket k each
receive buffer holds and the last delta it applied to bucket k; it brings the
standby buffer up to date after each commit, off the next push's path.
"""

from __future__ import annotations

import ctypes
import math

import msgspec
import numpy as np
import torch

from asyncrl.transports.weights.delta_native import Kernels, kernels
from asyncrl.transports.weights.delta_pack import CHUNK_BYTES, Segments, take_chunked

__all__ = [
    "DELTA_CAPABILITY",
    "DeltaEncoder",
    "DeltaInfo",
    "apply_payload",
    "payload_size",
]

DELTA_CAPABILITY = "asyncrl_weight_delta"
"""Key of ``/get_server_info`` by which an engine says it applies delta buckets (the embedded
engine does; SGLang does not, so it always gets full pushes)."""

SAMPLE_STRIDE = 61
"""``auto``: words compared to estimate a bucket's changed fraction (every 61st)."""


class DeltaInfo(msgspec.Struct, frozen=True, array_like=True):
    """A bucket sent as a delta: against version ``base``, ``nbytes`` of payload, its checksum."""

    base: int
    nbytes: int
    checksum: int | None = None


def payload_size(changed_words: int, nbytes: int) -> int:
    return 12 * changed_words + nbytes % 8


def _words(raw: torch.Tensor) -> torch.Tensor:
    """The whole 8-byte words of a flat uint8 buffer, as int64 (a view)."""
    return raw[: raw.numel() // 8 * 8].view(torch.int64)


def _changed(new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Indices (int64) of the words where ``new`` and ``old`` differ."""
    torch.ne(new, old, out=mask)
    if mask.device.type == "cpu":  # numpy's flatnonzero is ~2x torch's nonzero on CPU
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().squeeze(1)


def encode(new: torch.Tensor, old: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The payload of ``new`` (flat uint8) against ``old`` given the changed word indices."""
    nw, c = new.numel() // 8, idx.numel()
    out = torch.empty(payload_size(c, new.numel()), dtype=torch.uint8, device=new.device)
    torch.index_select(_words(new), 0, idx.to(new.device), out=out[: 8 * c].view(torch.int64))
    out[8 * c : 12 * c].view(torch.int32).copy_(idx)
    out[12 * c :].copy_(new[nw * 8 :])
    return out


def apply_payload(dst: torch.Tensor, payload: torch.Tensor) -> int:
    """Write a payload's words into ``dst`` (flat uint8); returns the changed word count."""
    tail = dst.numel() % 8
    c, rest = divmod(payload.numel() - tail, 12)
    if rest or c < 0:
        raise ValueError(f"a {payload.numel()} B delta does not fit a {dst.numel()} B bucket")
    words = _words(dst)
    native = _native(dst, payload)
    if native is not None:
        done = native.apply(_ptr(words), words.numel(), _ptr(payload), _ptr(payload, 8 * c), c)
        if done != c:
            raise ValueError(f"delta payload indexes words outside a {dst.numel()} B bucket")
    elif c:
        idx = payload[8 * c : 12 * c].view(torch.int32).to(torch.int64)
        if int(idx.min()) < 0 or int(idx.max()) >= words.numel():
            raise ValueError(f"delta payload indexes words outside a {dst.numel()} B bucket")
        words.index_copy_(0, idx, payload[: 8 * c].view(torch.int64))
    if tail:
        dst[dst.numel() - tail :].copy_(payload[12 * c :])
    return c


def _native(*tensors: torch.Tensor) -> Kernels | None:
    """The compiled loops when every tensor is a contiguous CPU buffer (else None)."""
    if all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return kernels()
    return None


def _ptr(t: torch.Tensor, offset: int = 0) -> int:
    """Address of byte ``offset`` of a contiguous tensor."""
    return t.data_ptr() + offset


class DeltaEncoder:
    """Sender side: the base of every bucket and the per-bucket choice (see module doc).

    Memory: the bases (one copy of the synced bytes) and a compare mask of one byte per
    8-byte word of the largest bucket (torch/numpy path only); a push's payloads live until
    it is delivered.
    """

    def __init__(self, mode: str):
        assert mode in ("auto", "on"), mode
        self.mode = mode
        self.bases: dict[int, torch.Tensor] = {}  # bucket index -> uint8 bytes pushed last
        self._mask: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None  # take_chunked's chunk
        self._changed: dict[int, int] = {}  # bucket -> changed words at its last push
        self._payloads: dict[int, torch.Tensor] = {}  # bucket -> its payload buffer, reused
        self.chunk_bytes = CHUNK_BYTES
        self.fused = True  # fp32 entries synced as bf16: cast while compared (delta_pack)
        self.stats: dict[str, float] = {}

    def reset(self) -> None:
        """Forget every base (the plan changed): memory is freed, the next push is full."""
        self.bases.clear()
        self._changed.clear()
        self._payloads.clear()
        self._mask = self._scratch = None

    def memory_bytes(self) -> int:
        """Bytes held between pushes: the bases, the compare mask (torch/numpy path), the
        chunk scratch and the payload buffers kept for the next push (compiled path)."""
        extra = sum(0 if t is None else t.numel() for t in (self._mask, self._scratch))
        extra += sum(p.untyped_storage().nbytes() for p in self._payloads.values())
        return sum(b.numel() for b in self.bases.values()) + extra

    def base(self, k: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """Bucket ``k``'s base (flat uint8), allocated at ``nbytes`` when it has none of that
        size: a push that sends no deltas packs straight into it and sends it."""
        base = self.bases.get(k)
        if base is None or base.numel() != nbytes:
            self.bases.pop(k, None)
            base = self.bases[k] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return base

    def take(self, k: int, packed: torch.Tensor, delta: bool) -> tuple[torch.Tensor | None, int]:
        """Bucket ``k`` was packed into ``packed`` (flat uint8, the caller's scratch: free
        again on return): bring bucket k's base to these bytes and return ``(payload,
        changed words)``; payload None: send the base whole (``delta`` false, no base yet,
        or not smaller). Costs a copy of the bucket when it goes whole, a write of the
        changed words when it goes as a delta.
        """
        old = self.bases.get(k)
        nbytes = packed.numel()
        if not delta or old is None or old.numel() != nbytes:
            self.base(k, nbytes, packed.device).copy_(packed)
            return None, -1
        new_w, old_w = _words(packed), _words(old)
        full_c = math.ceil(nbytes / 12)  # a payload of this many words is no smaller
        est = None
        if new_w.numel() >= 64 * SAMPLE_STRIDE:
            est = int((new_w[::SAMPLE_STRIDE] != old_w[::SAMPLE_STRIDE]).sum()) * SAMPLE_STRIDE
            if self.mode == "auto" and est >= 0.9 * full_c:
                old.copy_(packed)
                return None, -1
        native = _native(packed, old)
        if native is not None:
            return self._take_native(native, packed, old, est, full_c)
        if self._mask is None or self._mask.numel() < new_w.numel():
            self._mask = torch.empty(new_w.numel(), dtype=torch.bool, device=packed.device)
        idx = _changed(new_w, old_w, self._mask[: new_w.numel()])
        if self.mode == "auto" and idx.numel() >= full_c:
            old.copy_(packed)
            return None, idx.numel()
        payload = encode(packed, old, idx)
        old_w.index_copy_(0, idx.to(old.device), payload[: 8 * idx.numel()].view(torch.int64))
        self._copy_tail(packed, old)
        return payload, idx.numel()

    def take_chunked(
        self, k: int, segs: Segments, dtype: torch.dtype
    ) -> tuple[torch.Tensor | None, int] | None:
        """:meth:`take` of the bucket ``segs`` packs as ``dtype``, without packing it whole:
        chunk by chunk, each compared while in cache (``delta_pack``). None when that path
        does not apply (no compiled loops, not a CPU base, no base of this size): pack the
        bucket and call :meth:`take`."""
        base = self.bases.get(k)
        nbytes = segs.numel * dtype.itemsize
        native = None if base is None or base.numel() != nbytes else _native(base)
        if native is None or base is None:
            return None
        size = min(self.chunk_bytes, -(-nbytes // 64) * 8)  # at most an eighth of the bucket
        if self._scratch is None or self._scratch.numel() < size:
            self._scratch = torch.empty(size, dtype=torch.uint8)
        last = self._changed.get(k)
        guess = nbytes // 64 if last is None else nbytes if last < 0 else last + last // 4
        auto, reuse = self.mode == "auto", self._payloads.pop(k, None)
        payload, changed = take_chunked(
            native, segs, dtype, base, self._scratch, guess, auto, reuse, self.fused
        )
        self._changed[k] = changed
        if payload is not None and 4 * payload.untyped_storage().nbytes() <= nbytes:
            # kept for the next push (written again only once this push was delivered: a push
            # is packed after the last one's sends), so its pages are not mapped again; not
            # when it is large (more than a quarter of the bucket)
            self._payloads[k] = torch.empty(0, dtype=torch.uint8).set_(payload.untyped_storage())
        return payload, changed

    def _take_native(
        self, native: Kernels, packed: torch.Tensor, old: torch.Tensor, est: int | None, full_c: int
    ) -> tuple[torch.Tensor | None, int]:
        """:meth:`take` with the compiled loop: one pass that finds the changed words, writes
        them into the base, their values to the front of the payload and their indices
        behind room for ``cap`` values (the payload is sized from the estimate and grown
        when it was short); the indices are moved down behind the values at the end."""
        new_w, old_w = _words(packed), _words(old)
        n, nbytes = new_w.numel(), packed.numel()
        limit = full_c - 1 if self.mode == "auto" else n  # auto: more and it goes whole
        cap = limit if est is None else min(limit, max(4096, est + est // 4 + 4096))
        payload = torch.empty(12 * cap + nbytes % 8, dtype=torch.uint8)
        count, i = ctypes.c_int64(0), 0
        while True:
            i = native.encode(
                _ptr(new_w), _ptr(old_w), i, n, _ptr(payload), _ptr(payload, 8 * cap),
                ctypes.byref(count), cap,
            )  # fmt: skip
            if i == n:
                break
            if cap >= limit:  # auto: the payload would not be smaller; the rest of the base
                old.copy_(packed)  # is brought up to date at once, the bucket goes whole
                return None, -1
            grown_cap = min(limit, 2 * cap)  # the estimate was short: grow, keep what was found
            grown = torch.empty(12 * grown_cap + nbytes % 8, dtype=torch.uint8)
            c = count.value
            grown[: 8 * c].copy_(payload[: 8 * c])
            grown[8 * grown_cap : 8 * grown_cap + 4 * c].copy_(payload[8 * cap : 8 * cap + 4 * c])
            payload, cap = grown, grown_cap
        c = count.value
        ctypes.memmove(_ptr(payload, 8 * c), _ptr(payload, 8 * cap), 4 * c)  # may overlap
        out = payload[: 12 * c + nbytes % 8]
        out[12 * c :].copy_(packed[n * 8 :])
        self._copy_tail(packed, old)
        return out, c

    @staticmethod
    def _copy_tail(packed: torch.Tensor, old: torch.Tensor) -> None:
        """The bucket's last ``nbytes % 8`` bytes (no whole word) into the base."""
        tail = packed.numel() % 8
        if tail:
            old[packed.numel() - tail :].copy_(packed[packed.numel() - tail :])
