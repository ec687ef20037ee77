"""Flat weight buckets: named tensors packed into contiguous one-dtype buffers.

Layout is SGLang's ``load_format="flattened_bucket"``: the tensors of a bucket
are flattened and concatenated in manifest order; ``names``/``dtypes``/``shapes``
describe them. A bucket holds one dtype and at most ``bucket_bytes`` bytes,
except a single tensor larger than that, which gets a bucket of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import msgspec
import torch

__all__ = ["BucketManifest", "TensorSpec", "pack_into", "plan_buckets", "unpack"]


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class BucketManifest(msgspec.Struct, frozen=True):
    """One bucket: what it holds, in order, and its size."""

    specs: tuple[TensorSpec, ...]
    index: int
    count: int

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.specs[0].dtype)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[BucketManifest]:
    """Group specs into buckets of one dtype each, in order within a dtype, bounded in bytes."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    groups: list[list[TensorSpec]] = []
    open_by_dtype: dict[str, tuple[list[TensorSpec], int]] = {}
    for spec in specs:
        size = spec.numel * getattr(torch, spec.dtype).itemsize
        current = open_by_dtype.get(spec.dtype)
        if current is None or current[1] + size > bucket_bytes:
            bucket: list[TensorSpec] = []
            groups.append(bucket)
            current = (bucket, 0)
        current[0].append(spec)
        open_by_dtype[spec.dtype] = (current[0], current[1] + size)
    return [BucketManifest(tuple(g), i, len(groups)) for i, g in enumerate(groups)]


def pack_into(flat: torch.Tensor, tensors: Iterable[torch.Tensor]) -> None:
    """Copy tensors, flattened, back to back into ``flat`` (a staging buffer)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        flat[offset : offset + n].copy_(t.reshape(-1))
        offset += n
    assert offset == flat.numel(), f"packed {offset} of {flat.numel()} elements"


def unpack(flat: torch.Tensor, manifest: BucketManifest) -> list[tuple[str, torch.Tensor]]:
    """Views of ``flat`` as the manifest's named tensors (no copy)."""
    out = []
    offset = 0
    for spec in manifest.specs:
        out.append((spec.name, flat[offset : offset + spec.numel].view(spec.shape)))
        offset += spec.numel
    if offset != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} elements, manifest describes {offset}")
    return out
