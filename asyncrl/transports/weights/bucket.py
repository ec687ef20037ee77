"""Flat weight buckets: named tensors packed into contiguous one-dtype buffers.

Layout is SGLang's ``load_format="flattened_bucket"``: the entries of a bucket
are flattened and concatenated in manifest order. A bucket holds one dtype and
at most ``bucket_bytes`` bytes. A tensor larger than a bucket is *chunked*: it
is cut into element ranges of the flattened tensor, each range an entry of its
own (``start``/``numel``), in consecutive buckets; the receiver reassembles it.

Each bucket travels with its :class:`BucketManifest` (entries, index, count,
version and a checksum of the bucket's bytes, see :func:`checksum`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import msgspec
import numpy as np
import torch

from asyncrl.transports.weights.delta import DeltaInfo
from asyncrl.transports.weights.seam import BucketAnnouncement

__all__ = [
    "BucketEntry",
    "BucketManifest",
    "TensorSpec",
    "assemble",
    "checksum",
    "pack_checksum",
    "pack_into",
    "plan_buckets",
    "span_of",
    "spec_of",
]

_MASK64 = (1 << 64) - 1


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """A whole named tensor: name, dtype (torch name without ``torch.``), shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * getattr(torch, self.dtype).itemsize


class BucketEntry(msgspec.Struct, frozen=True, array_like=True):
    """Elements ``[start, start + numel)`` of the flattened tensor ``name`` of ``shape``."""

    name: str
    shape: tuple[int, ...]
    start: int = 0
    numel: int = -1  # -1: the whole tensor

    @property
    def size(self) -> int:
        return math.prod(self.shape) if self.numel < 0 else self.numel

    @property
    def whole(self) -> bool:
        return self.numel < 0 or (self.start == 0 and self.numel == math.prod(self.shape))

    @property
    def wire_shape(self) -> list[int]:
        """Shape of these elements as they lie in the bucket (SGLang's ``shapes`` field)."""
        return list(self.shape) if self.whole else [self.numel]


class BucketManifest(msgspec.Struct, frozen=True):
    """One bucket: what it holds, in order, plus its place in a push and its checksum."""

    dtype: str
    entries: tuple[BucketEntry, ...]
    index: int
    count: int
    version: int = -1
    checksum: int | None = None  # None: sent without a checksum (``weights.verify = off``)
    verify: str = "full"  # what ``checksum`` covers: "full" or "sampled" (see ``integrity``)
    delta: DeltaInfo | None = None  # sent as the changed words against an earlier version

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def numel(self) -> int:
        return sum(e.size for e in self.entries)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    def announcement(self, group_name: str) -> BucketAnnouncement:
        """This bucket as announced to an engine over group ``group_name``: its entries'
        names and shapes as they lie in it, its dtype for each; the other fields at their
        defaults, for the engine's family to set (``msgspec.structs.replace``)."""
        names = [e.name for e in self.entries]
        shapes = [e.wire_shape for e in self.entries]
        return BucketAnnouncement(names, [self.dtype] * len(names), shapes, group_name)


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def plan_buckets(
    specs: Sequence[TensorSpec], bucket_bytes: int, min_buckets: int = 1, whole_only: bool = False
) -> list[BucketManifest]:
    """Cut ``specs`` into buckets of one dtype each, bounded by ``bucket_bytes``.

    Within a dtype the order of ``specs`` is kept. Whole tensors are grouped up
    to a fill target of ``min(bucket_bytes, total / min_buckets)`` (at least
    1 MiB) so a sync has enough buckets for packing, sending and verifying to
    overlap; a tensor that alone exceeds the target but not ``bucket_bytes``
    gets a bucket of its own. Only a tensor larger than ``bucket_bytes`` is
    chunked, into element ranges that fill buckets up to ``bucket_bytes``;
    with ``whole_only`` (SGLang, which loads every entry as the whole named
    tensor and cannot load a chunk) it gets a bucket of its own instead.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    if min_buckets <= 0:
        raise ValueError(f"min_buckets must be > 0, got {min_buckets}")
    total = sum(s.nbytes for s in specs)
    target = min(bucket_bytes, max(math.ceil(total / min_buckets), 1 << 20))
    groups: list[tuple[str, list[BucketEntry]]] = []
    open_by_dtype: dict[str, tuple[list[BucketEntry], int]] = {}

    def new_bucket(dtype: str) -> tuple[list[BucketEntry], int]:
        groups.append((dtype, []))
        return groups[-1][1], 0

    for spec in specs:
        item = getattr(torch, spec.dtype).itemsize
        cap, fill = max(bucket_bytes // item, 1), max(target // item, 1)  # elements
        entries, used = open_by_dtype.get(spec.dtype) or new_bucket(spec.dtype)
        if spec.numel > cap and whole_only:  # a bucket of its own, over the bound
            if used > 0:
                entries, used = new_bucket(spec.dtype)
            entries.append(BucketEntry(spec.name, spec.shape))
            used = cap
        elif spec.numel <= cap:  # whole: in the open bucket while it stays under the fill target
            if used > 0 and used + spec.numel > fill:
                entries, used = new_bucket(spec.dtype)
            entries.append(BucketEntry(spec.name, spec.shape))
            used += spec.numel
        else:  # larger than a bucket: element ranges, filling buckets up to the bound
            start = 0
            while start < spec.numel:
                if used == cap:
                    entries, used = new_bucket(spec.dtype)
                take = min(cap - used, spec.numel - start)
                entries.append(BucketEntry(spec.name, spec.shape, start, take))
                used, start = used + take, start + take
        open_by_dtype[spec.dtype] = (entries, used)
    n = len(groups)
    return [BucketManifest(d, tuple(e), i, n) for i, (d, e) in enumerate(groups)]


def span_of(
    manifest: BucketManifest, tensors: Mapping[str, torch.Tensor], device: torch.device
) -> torch.Tensor | None:
    """The bucket as one flat view of the tensors' own memory, or None when it is not one.

    It is one when its entries (whole tensors or element ranges of them) are
    contiguous, on ``device``, of the bucket's dtype, and lie back to back in one
    storage in manifest order: then the packed bucket would equal these bytes.
    """
    storage, start, end = None, 0, 0
    for e in manifest.entries:
        t = tensors[e.name]
        if not t.is_contiguous() or t.device != device or t.dtype != manifest.torch_dtype:
            return None
        offset = int(t.storage_offset()) + (0 if e.whole else e.start)  # int | SymInt
        if storage is None:
            storage, start, end = t.untyped_storage(), offset, offset
        elif t.untyped_storage().data_ptr() != storage.data_ptr() or offset != end:
            return None
        end = offset + e.size
    assert storage is not None
    flat = torch.empty(0, dtype=manifest.torch_dtype, device=device)
    return flat.set_(storage, start, (end - start,), (1,))


def pack_into(
    flat: torch.Tensor, manifest: BucketManifest, tensors: Mapping[str, torch.Tensor]
) -> None:
    """Copy the manifest's entries of ``tensors``, flattened, back to back into ``flat``."""
    for _ in _pack_steps(flat, manifest, tensors):
        pass


def pack_checksum(
    flat: torch.Tensor, manifest: BucketManifest, tensors: Mapping[str, torch.Tensor]
) -> int:
    """:func:`pack_into`, returning :func:`checksum` of ``flat`` once packed.

    On CPU the checksum blocks are summed right after the copy that completed
    them, while their bytes are still in cache, so checksumming costs the sender
    almost no extra memory traffic.
    """
    if flat.device.type != "cpu":
        pack_into(flat, manifest, tensors)
        return checksum(flat)
    raw = _bytes_np(flat)
    sums, done = [], 0
    for end in _pack_steps(flat, manifest, tensors):
        upto = end * flat.element_size() // _BLOCK_BYTES
        if upto > done:
            sums.append(_block_sums_np(raw, done, upto))
            done = upto
    return _combine_np(raw, sums, done)


def _pack_steps(
    flat: torch.Tensor, manifest: BucketManifest, tensors: Mapping[str, torch.Tensor]
) -> Iterator[int]:
    """Copy entry after entry into ``flat``, yielding the element offset packed so far."""
    offset = 0
    for e in manifest.entries:
        src = tensors[e.name].reshape(-1)
        if not e.whole:
            src = src[e.start : e.start + e.numel]
        flat[offset : offset + src.numel()].copy_(src)
        offset += src.numel()
        yield offset
    assert offset == flat.numel(), f"packed {offset} of {flat.numel()} elements"


_BLOCK = 1 << 16  # 8-byte words per checksum block
_BLOCK_BYTES = 8 * _BLOCK


def checksum(flat: torch.Tensor) -> int:
    """64-bit checksum of a contiguous buffer's bytes (same value on CPU and CUDA).

    Sums of the 8-byte words per block of 2**16 words, combined as
    ``sum(block_sum) + 1000003 * sum(i * block_sum_i)`` modulo 2**64, so a flipped
    bit anywhere and a swap of blocks both change it. Integer sums are
    associative, so the value does not depend on the device or thread count.
    On CPU it is computed with numpy (one pass over memory, no temporaries).
    """
    if flat.device.type == "cpu":
        raw = _bytes_np(flat)
        nblocks = raw.size // _BLOCK_BYTES
        return _combine_np(raw, [_block_sums_np(raw, 0, nblocks)], nblocks)
    return _checksum_torch(flat)


def _checksum_torch(flat: torch.Tensor) -> int:
    """:func:`checksum` with torch ops, on the tensor's own device (CUDA, NPU)."""
    raw = flat.reshape(-1).view(torch.uint8)
    n8 = raw.numel() // 8
    words = raw[: n8 * 8].view(torch.int64)
    nblocks = n8 // _BLOCK
    sums = words[: nblocks * _BLOCK].view(nblocks, _BLOCK).sum(1)
    rest = words[nblocks * _BLOCK :].sum().reshape(1)
    tail = raw[n8 * 8 :].to(torch.int64) << (
        8 * torch.arange(raw.numel() - n8 * 8, device=raw.device)
    )
    sums = torch.cat([sums, rest + tail.sum()])
    idx = torch.arange(1, sums.numel() + 1, device=sums.device, dtype=torch.int64)
    return _finish(int(sums.sum()), int((sums * idx).sum()), raw.numel())


def _finish(s1: int, s2: int, nbytes: int) -> int:
    value = (s1 + 1000003 * s2 + nbytes) & _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value  # signed: fits JSON int64


def _bytes_np(flat: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat numpy uint8 array (no copy)."""
    return flat.detach().reshape(-1).view(torch.uint8).numpy()


def _block_sums_np(raw: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Wrapping uint64 sums of the words of checksum blocks ``[lo, hi)`` of ``raw``."""
    words = raw[lo * _BLOCK_BYTES : hi * _BLOCK_BYTES].view(np.uint64)
    return np.add.reduce(words.reshape(hi - lo, _BLOCK), axis=1, dtype=np.uint64)


def _combine_np(raw: np.ndarray, sums: list[np.ndarray], nblocks: int) -> int:
    """Finish :func:`checksum` from the sums of its first ``nblocks`` complete blocks."""
    n8 = raw.size // 8
    rest = int(raw[nblocks * _BLOCK_BYTES : n8 * 8].view(np.uint64).sum(dtype=np.uint64))
    tail = sum(int(b) << (8 * i) for i, b in enumerate(raw[n8 * 8 :].tolist()))
    last = np.array([(rest + tail) & _MASK64], dtype=np.uint64)
    all_sums = np.concatenate([*sums, last])
    idx = np.arange(1, all_sums.size + 1, dtype=np.uint64)
    s1 = int(all_sums.sum(dtype=np.uint64))
    s2 = int(np.dot(all_sums, idx))
    return _finish(s1, s2, raw.size)


def assemble(
    buckets: Sequence[tuple[BucketManifest, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """Named tensors from received buckets: whole entries are views, chunks are joined.

    Raises ValueError when a chunked tensor is incomplete.
    """
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[tuple[BucketEntry, torch.Tensor]]] = {}
    for manifest, flat in buckets:
        if flat.numel() != manifest.numel:
            got, want = flat.numel(), manifest.numel
            raise ValueError(f"bucket {manifest.index} holds {got} elements, manifest says {want}")
        offset = 0
        for e in manifest.entries:
            view = flat[offset : offset + e.size]
            offset += e.size
            if e.whole:
                out[e.name] = view.view(e.shape)
            else:
                pieces.setdefault(e.name, []).append((e, view))
    for name, parts in pieces.items():
        parts.sort(key=lambda p: p[0].start)
        shape = parts[0][0].shape
        covered = 0
        for e, _ in parts:
            if e.start != covered:
                raise ValueError(f"{name}: chunk at element {e.start}, expected {covered}")
            covered += e.numel
        if covered != math.prod(shape):
            raise ValueError(f"{name}: chunks cover {covered} of {math.prod(shape)} elements")
        out[name] = torch.cat([v for _, v in parts]).view(shape)
    return list(out.items())
