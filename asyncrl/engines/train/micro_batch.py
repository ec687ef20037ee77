"""Micro-batching: balanced splits of a batch by a token budget, and padded inputs."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from asyncrl.engines.train.base import Seq

__all__ = ["pad_inputs", "split_by_tokens"]


def split_by_tokens(lengths: Sequence[int], budget: int, min_count: int = 1) -> list[list[int]]:
    """Indices of ``lengths`` in k balanced groups, k the fewest whose padded size fits ``budget``.

    Greedy longest-first into the lightest group; each group's indices are sorted.
    A sequence longer than the budget gets a group of its own (never refused).
    """
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    k = max(min_count, -(-sum(lengths) // budget))
    while True:
        heap = [(0, g) for g in range(k)]
        groups: list[list[int]] = [[] for _ in range(k)]
        for i in order:
            load, g = heapq.heappop(heap)
            groups[g].append(i)
            heapq.heappush(heap, (load + lengths[i], g))
        padded = [len(g) * max((lengths[i] for i in g), default=0) for g in groups]
        if all(p <= budget or len(g) == 1 for p, g in zip(padded, groups, strict=True)):
            return [sorted(g) for g in groups if g] + [[] for g in groups if not g]
        k += 1


def pad_inputs(seqs: Sequence[Seq], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``attention_mask`` of a micro-batch."""
    width = max(len(s.input_ids) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s.input_ids)] = s.input_ids
        mask[i, : len(s.input_ids)] = 1
    return ids, mask
