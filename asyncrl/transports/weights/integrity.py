"""What an engine checks of a received bucket (``weights.verify = full | sampled | off``).

- ``full``: :func:`~asyncrl.transports.weights.bucket.checksum` of every byte of the
  bucket, combined with the ``sampled`` value below. The word sums catch any change
  of a word's bits (a lone flipped bit included) but not words moved within a
  checksum block (512 KiB: a bucket shifted by whole words keeps its sums); the
  sampled part, positional, catches those. Costs one read of the bucket per side.
- ``sampled``: the same checksum over a fixed subset of the bucket's bytes, chosen
  from the manifest alone (both sides compute it): the first and last
  :data:`EDGE_BYTES` of every entry (tensor or chunk) plus :data:`BLOCKS` blocks
  of :data:`BLOCK_BYTES`, one in each of :data:`BLOCKS` equal stretches of the
  bucket at an offset seeded by (version, bucket index). A bucket that is
  misordered (another bucket's bytes), shifted, truncated (its tail never
  written) or torn (a stretch from an older push or another buffer) differs in an
  entry boundary or in a block with certainty when the damage spans two stretches
  (1/16 of the bucket), and with the probability that a block lands in it when
  smaller. It does not catch a lone flipped bit outside the subset. Costs
  ~(2 * EDGE_BYTES * entries + BLOCKS * BLOCK_BYTES) bytes read per bucket.
- ``off``: nothing.

The value travels in the manifest's ``checksum`` field, ``verify`` says which.
"""

from __future__ import annotations

import random
from typing import Literal

import numpy as np
import torch

from asyncrl.transports.weights.bucket import BucketManifest, checksum

__all__ = [
    "BLOCKS",
    "BLOCK_BYTES",
    "EDGE_BYTES",
    "VerifyMode",
    "bucket_checksum",
    "full_checksum",
    "sample_ranges",
]

VerifyMode = Literal["full", "sampled", "off"]

_MASK64 = (1 << 64) - 1
EDGE_BYTES = 64
"""Bytes checked at each end of every entry."""
BLOCKS = 32
"""Spread blocks per bucket (one per 1/BLOCKS of the bucket)."""
BLOCK_BYTES = 4096
"""Bytes per spread block."""


def sample_ranges(m: BucketManifest) -> list[tuple[int, int]]:
    """The byte ranges ``(start, end)`` of bucket ``m`` that ``sampled`` checks, in order."""
    nbytes, item = m.nbytes, m.torch_dtype.itemsize
    ranges: list[tuple[int, int]] = []
    offset = 0
    for e in m.entries:
        size = e.size * item
        edge = min(EDGE_BYTES, size)
        ranges += [(offset, offset + edge), (offset + size - edge, offset + size)]
        offset += size
    if nbytes > BLOCKS * BLOCK_BYTES:
        rng = random.Random(m.version * 1_000_003 + m.index)
        stretch = nbytes // BLOCKS
        for i in range(BLOCKS):
            start = i * stretch + rng.randrange(max(1, stretch - BLOCK_BYTES))
            ranges.append((start, start + BLOCK_BYTES))
    else:  # a small bucket: every byte
        ranges.append((0, nbytes))
    return ranges


def bucket_checksum(flat: torch.Tensor, m: BucketManifest, mode: VerifyMode) -> int | None:
    """The value the sender puts in ``m.checksum`` and the engine recomputes (None: ``off``)."""
    if mode == "off":
        return None
    if mode == "sampled":
        return _sampled(flat, m)
    return full_checksum(flat, m, checksum(flat))


def full_checksum(flat: torch.Tensor, m: BucketManifest, words: int) -> int:
    """``full``'s value from ``words`` = :func:`checksum` of ``flat`` (fused into a copy)."""
    value = (words ^ ((_sampled(flat, m) * 0x9E3779B97F4A7C15) >> 7)) & _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _sampled(flat: torch.Tensor, m: BucketManifest) -> int:
    raw = flat.detach().reshape(-1).view(torch.uint8)
    ranges = sample_ranges(m)
    if raw.device.type == "cpu":
        arr = raw.numpy()
        picked = torch.from_numpy(np.concatenate([arr[a:b] for a, b in ranges]))
    else:
        picked = torch.cat([raw[a:b] for a, b in ranges])
    return checksum(picked)
