"""Micro-batching: balanced splits by a token budget, input preparation, output preparation.

Input preparation turns a few ``Seq``s into model inputs, either *packed* (one
row, no padding, position ids restarting at 0 for each sequence: the attention
backend derives a block-diagonal causal mask from them) or *padded* (one
right-padded row per sequence with an attention mask). Either way it also
records which output positions predict the response tokens, so output
preparation is one ``index_select`` whatever the layout.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from asyncrl.engines.train.base import Seq

__all__ = [
    "MicroBatch",
    "prepare_inputs",
    "response_entropy",
    "response_logprobs",
    "response_values",
    "split_by_tokens",
]


def split_by_tokens(lengths: Sequence[int], budget: int, min_count: int = 1) -> list[list[int]]:
    """Indices of ``lengths`` in k balanced groups, k the fewest whose padded size fits ``budget``.

    Greedy longest-first into the lightest group; each group's indices are sorted.
    A sequence longer than the budget gets a group of its own (never refused).
    At least ``min_count`` groups are returned (empty ones last).
    """
    if not lengths:
        return [[] for _ in range(min_count)] if min_count > 1 else []
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


@dataclass
class MicroBatch:
    """One prepared micro-batch. ``seqs`` are copies (own ``fields`` dicts) of the batch's."""

    seqs: list[Seq]
    inputs: dict[str, torch.Tensor | int]
    """Model keyword arguments (``input_ids`` and ``position_ids`` or ``attention_mask``,
    and ``logits_to_keep`` when the outputs are trimmed to the response positions)."""
    gather: torch.Tensor
    """Flat index into the model output rows (batch * kept positions) of every position
    that predicts a response token, sequences in order."""
    targets: torch.Tensor
    """The response token ids, concatenated in the order of ``seqs``."""
    lengths: list[int]
    """Response length of each sequence."""


def prepare_inputs(seqs: Sequence[Seq], packed: bool, trim: bool, pad_id: int = 0) -> MicroBatch:
    """Input preparation for a non-empty micro-batch.

    ``trim``: ask the model for logits only where they are needed (``logits_to_keep``:
    the response positions when packed, the trailing columns from the earliest
    response position when padded).
    """
    assert seqs, "an empty micro-batch has no inputs"
    copies = [replace(s, fields=dict(s.fields)) for s in seqs]
    lengths = [s.response_len for s in seqs]
    targets = torch.cat([s.input_ids[s.prompt_len :] for s in seqs])
    if packed:
        ids = torch.cat([s.input_ids for s in seqs])[None]
        pos = torch.cat([torch.arange(len(s.input_ids)) for s in seqs])[None]
        starts = torch.tensor([0, *(len(s.input_ids) for s in seqs)]).cumsum(0)[:-1].tolist()
        gather = torch.cat(
            [
                torch.arange(o + s.prompt_len - 1, o + len(s.input_ids) - 1)
                for o, s in zip(starts, seqs, strict=True)
            ]
        )
        inputs: dict[str, torch.Tensor | int] = {"input_ids": ids, "position_ids": pos}
        if trim:
            inputs["logits_to_keep"] = gather
            gather = torch.arange(len(gather))
        return MicroBatch(copies, inputs, gather, targets, lengths)
    width = max(len(s.input_ids) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s.input_ids)] = s.input_ids
        mask[i, : len(s.input_ids)] = 1
    first = min(s.prompt_len for s in seqs) - 1 if trim else 0
    kept = width - first
    gather = torch.cat(
        [
            torch.arange(
                i * kept + s.prompt_len - 1 - first, i * kept + len(s.input_ids) - 1 - first
            )
            for i, s in enumerate(seqs)
        ]
    )
    inputs = {"input_ids": ids, "attention_mask": mask}
    if trim:
        inputs["logits_to_keep"] = kept
    return MicroBatch(copies, inputs, gather, targets, lengths)


def _rows(logits: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """float32 logits of the positions predicting the response tokens, (tokens, vocab)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return flat.index_select(0, mb.gather.to(logits.device)).float()


def response_logprobs(logits: torch.Tensor, mb: MicroBatch) -> list[torch.Tensor]:
    """Output preparation (actor): float32 log-prob of every response token, per sequence."""
    rows = _rows(logits, mb)
    targets = mb.targets.to(logits.device)
    logp = rows.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(rows, dim=-1)
    return list(logp.split(mb.lengths))


def response_entropy(logits: torch.Tensor, mb: MicroBatch) -> list[torch.Tensor]:
    """Output preparation (actor): float32 entropy of the predicted distribution at each
    position predicting a response token, per sequence."""
    logp = torch.log_softmax(_rows(logits, mb), dim=-1)
    return list((-(logp.exp() * logp).sum(-1)).split(mb.lengths))


def response_values(values: torch.Tensor, mb: MicroBatch) -> list[torch.Tensor]:
    """Output preparation (critic): float32 value at each position predicting a response token."""
    flat = values.reshape(-1).index_select(0, mb.gather.to(values.device)).float()
    return list(flat.split(mb.lengths))
