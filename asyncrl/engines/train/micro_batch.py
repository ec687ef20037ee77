"""Micro-batching: balanced splits by a token budget, input preparation, output preparation.

Input preparation turns a few ``Seq``s into model inputs, either *packed* (one
row, no padding, position ids restarting at 0 for each sequence: the attention
backend derives a block-diagonal causal mask from them) or *padded* (one
right-padded row per sequence; with a causal model no attention mask, since no
real position can attend to the padding after it). Either way it also
records which output positions predict the response tokens, so output
preparation is one ``index_select`` whatever the layout.

Two ways to split a batch: :func:`split_by_tokens` (balanced groups, for packed rows
whose attention costs each sequence's own: a variable-length kernel) and
:func:`split_by_cost` (sequences of similar lengths together, for padded rows and for
backends that attend over a packed row's every token).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.engines.train.base import Seq

__all__ = [
    "MicroBatch",
    "micro_batch_overhead",
    "packing_pays",
    "prepare_inputs",
    "response_entropy",
    "response_logprobs",
    "response_values",
    "split_by_cost",
    "split_by_tokens",
    "token_cost",
]

MICRO_BATCH_OVERHEAD_MACS = 8_000_000
"""A micro-batch's fixed cost per decoder layer, in multiply-adds of model work: dispatching its
forward's and backward's operators, whatever its size. Measured on one CPU core (2026-11-29):
a forward+backward of 8 tokens through the 2-layer default model takes 2.1 ms, ~1 ms per
layer, the work of ~120 of its tokens (65k multiply-adds per token and layer, x3 with backward)."""


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


def split_by_cost(
    lengths: Sequence[int], budget: int, token_cost: float, overhead: float, min_count: int = 1
) -> list[list[int]]:
    """Indices of ``lengths`` in the groups of least modelled compute as right-padded rows.

    Sequences are taken longest first and cut into runs of consecutive lengths (so a group
    pads to sequences of similar lengths); the cuts minimise the sum over groups of
    ``overhead + n * w * (token_cost + w)`` (``n`` sequences padded to width ``w``: every
    padded token's matmul work, the attention pairs of its row — :func:`packing_pays`'s
    units — and the group's fixed cost, :func:`micro_batch_overhead`), with ``n * w <=
    budget`` unless ``n == 1`` (a sequence longer than the budget gets a group of its own).
    Each group's indices are sorted; at least ``min_count`` groups are returned (empty ones
    last)."""
    n = len(lengths)
    order = sorted(range(n), key=lambda i: -lengths[i])
    w = [max(lengths[i], 1) for i in order]
    width = np.array(w, dtype=np.float64)
    pad_cost = width * (token_cost + width)  # per padded row of each width
    start = np.arange(n, dtype=np.float64)
    best = np.zeros(n + 1)  # best[j]: the j longest sequences split at least cost
    cut = [0] * (n + 1)
    lo = 0  # the longest group ending at j starts at lo: rows x width grows as lo falls,
    for j in range(1, n + 1):  # and with j, so lo never moves back
        while lo < j - 1 and (j - lo) * w[lo] > budget:
            lo += 1
        cost = best[lo:j] + (j - start[lo:j]) * pad_cost[lo:j]
        k = int(np.argmin(cost))
        best[j], cut[j] = cost[k] + overhead, lo + k
    groups: list[list[int]] = []
    j = n
    while j > 0:
        groups.append(sorted(order[cut[j] : j]))
        j = cut[j]
    groups.reverse()
    return groups + [[] for _ in range(min_count - len(groups))]


def micro_batch_overhead(config: object) -> float:
    """:data:`MICRO_BATCH_OVERHEAD_MACS` in units of one attention pair's work (those of
    :func:`token_cost`), from a Hugging Face model config."""
    h = int(getattr(config, "hidden_size", 0) or 0)
    if not h:
        return 0.0
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    head_dim = int(getattr(config, "head_dim", 0) or h // heads)
    return MICRO_BATCH_OVERHEAD_MACS / (2 * heads * head_dim)


@dataclass
class MicroBatch:
    """One prepared micro-batch. ``seqs`` are copies (own ``fields`` dicts) of the batch's."""

    seqs: list[Seq]
    inputs: dict[str, torch.Tensor | int]
    """Model keyword arguments (``input_ids``; ``position_ids`` when packed, ``attention_mask``
    when padded for a model that is not causal; ``logits_to_keep`` when the outputs are
    trimmed to the response positions)."""
    gather: torch.Tensor
    """Flat index into the model output rows (batch * kept positions) of every position
    that predicts a response token, sequences in order."""
    targets: torch.Tensor
    """The response token ids, concatenated in the order of ``seqs``."""
    lengths: list[int]
    """Response length of each sequence."""


def prepare_inputs(
    seqs: Sequence[Seq], packed: bool, trim: bool, pad_id: int = 0, causal: bool = False
) -> MicroBatch:
    """Input preparation for a non-empty micro-batch.

    ``trim``: ask the model for logits only where they are needed (``logits_to_keep``:
    the response positions when packed, the trailing columns from the earliest
    response position when padded). ``causal``: the model attends causally, so padded rows
    go without an attention mask (every row is right-padded: a real position's keys are
    all real; the backend takes its causal path — SDPA's flash kernel skips the masked
    half — and no mask is built; outputs at padded positions are never read). A handful
    of whole-batch tensor operations, whatever the number of sequences (no per-sequence
    tensor work).
    """
    assert seqs, "an empty micro-batch has no inputs"
    copies = [Seq(s.input_ids, s.prompt_len, dict(s.fields)) for s in seqs]
    lens = [s.input_ids.shape[0] for s in seqs]
    prompts = [s.prompt_len for s in seqs]
    lengths = [n - p for n, p in zip(lens, prompts, strict=True)]
    flat = torch.cat([s.input_ids for s in seqs])
    size = torch.tensor(lens)
    # per flat position: its sequence, its offset in the sequence, whether it is a response token
    row = torch.repeat_interleave(torch.arange(len(seqs)), size)
    starts = size.cumsum(0) - size
    pos = torch.arange(flat.shape[0]) - starts[row]
    response = pos >= torch.tensor(prompts)[row]
    targets = flat[response]
    if packed:
        # the position before each response token predicts it (prompt_len >= 1: same sequence)
        gather = response.nonzero().squeeze(1) - 1
        inputs: dict[str, torch.Tensor | int] = {"input_ids": flat[None], "position_ids": pos[None]}
        if trim:
            inputs["logits_to_keep"] = gather
            gather = torch.arange(len(gather))
        return MicroBatch(copies, inputs, gather, targets, lengths)
    width = max(lens)
    ids = torch.full((len(seqs), width), pad_id, dtype=flat.dtype)
    ids[row, pos] = flat
    first = min(prompts) - 1 if trim else 0
    kept = width - first
    gather = (row * kept + pos - 1 - first)[response]
    inputs = {"input_ids": ids}
    if not causal:
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        mask[row, pos] = 1
        inputs["attention_mask"] = mask
    if trim:
        inputs["logits_to_keep"] = kept
    return MicroBatch(copies, inputs, gather, targets, lengths)


def packing_pays(lengths: Sequence[int], token_cost: float, varlen: bool) -> bool:
    """Whether one packed row of sequences of ``lengths`` costs less compute than right-padded
    rows (one per sequence).

    Cost = tokens x ``token_cost`` + attention pairs, ``token_cost`` being one token's
    per-layer matmul work in units of one (query, key) pair's (see :func:`token_cost`).
    Padded: every row is as wide as the longest sequence, and attends within its row.
    Packed: no padding, but without a variable-length kernel (``varlen``: FlashAttention's
    varlen path, flex attention's block mask) the backend (SDPA, eager) attends over the
    whole row under a block-diagonal mask: quadratic in the micro-batch's tokens, which for
    many short sequences costs far more than the padding it saves.
    """
    n, width, total = len(lengths), max(lengths, default=0), sum(lengths)
    padded = n * width * (token_cost + width)
    pairs = sum(x * x for x in lengths) if varlen else total * total
    return total * token_cost + pairs < padded


def token_cost(config: object) -> float:
    """One token's per-layer matmul work (projections and MLP) over one attention pair's
    (the query-key product and the value sum), from a Hugging Face model config."""
    h = int(getattr(config, "hidden_size", 0) or 0)
    if not h:
        return 0.0
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    head_dim = int(getattr(config, "head_dim", 0) or h // heads)
    kv = int(getattr(config, "num_key_value_heads", heads) or heads) * head_dim
    inner = int(getattr(config, "intermediate_size", 4 * h) or 4 * h)
    per_token = 2 * h * heads * head_dim + 2 * h * kv + 3 * h * inner
    return per_token / (2 * heads * head_dim)


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
