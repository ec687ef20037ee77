"""Decode attention over a left-padded batch without reading its padding.

A decode step attends one new token per row to the row's cached keys/values,
which end at the batch's right edge (:mod:`~asyncrl.engines.rollout.local.kv`).
Plain SDPA reads every row at the batch's full width — the longest sequence's —
so with long-tailed lengths (continuous batching mixes a 500-token straggler
with 10-token newcomers) most of the keys/values it reads are padding, and
decode attention is bound by exactly those reads. Here the rows (kept roughly
longest-first by the cache) are cut into a few contiguous *buckets*; each
bucket attends to only the last ``n`` columns its longest row needs. The result
is identical (the cut columns are masked padding); prefill and every other
call go to the stock SDPA path.

:func:`plan` chooses the buckets; the engine passes them to the model as the
``decode_plan`` keyword, which transformers hands through to this attention
function (registered as ``asyncrl_bucketed``, with SDPA's mask format).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["NAME", "Plan", "enable", "plan"]

NAME = "asyncrl_bucketed"

Plan = list[tuple[int, int, int]]
"""Buckets ``(first_row, end_row, columns)``: rows ``[first_row, end_row)`` read only the
last ``columns`` columns of the keys/values."""

MIN_SAVED = 512
"""A bucket is cut only where it spares at least this many cells (rows x columns) of the
attention's reads: each bucket adds its attention calls to every layer (~20 us per layer on
a CPU core for a small model), and a cell costs ~6 ns per head and layer there."""
SHRINK = 0.6  # a new bucket starts where a row needs < SHRINK x the current bucket's width


def plan(lens: Sequence[int], width: int) -> tuple[Plan | None, int]:
    """Buckets for rows of cached lengths ``lens`` (+1 new token each) in a batch ``width``
    wide, and the columns they read; None when one full-width call is as good.

    Greedy over the rows in their order (longest first when sorted): a new bucket starts at
    a row that needs under ``SHRINK`` x the current bucket's columns when giving it and
    every later row only that row's columns spares at least ``MIN_SAVED`` cells — so a
    short batch beside one long straggler (continuous batching of overlapping batches: a
    512-token row among 10-30-token ones) reads each short row's own columns, not the
    straggler's."""
    rows = len(lens)
    if rows < 2:
        return None, rows * (width + 1)
    out: Plan = []
    start, n = 0, lens[0] + 1
    for i in range(1, rows):
        need = lens[i] + 1
        if need > n:  # out of order (a row moved into a hole): this bucket widens
            n = need
        elif need < SHRINK * n and (n - need) * (rows - i) >= MIN_SAVED:
            out.append((start, i, n))
            start, n = i, need
    out.append((start, rows, n))
    cells = sum((b - a) * n for a, b, n in out)
    if len(out) == 1:
        return None, rows * (width + 1)
    return out, cells


def bucketed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    decode_plan: Plan | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA, by buckets of rows when the engine passed a ``decode_plan`` (one query token)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if decode_plan is None or query.shape[2] != 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    gqa = query.shape[1] != key.shape[1]
    out = torch.empty_like(query)  # (rows, heads, 1, head_dim)
    for a, b, n in decode_plan:
        mask = None if attention_mask is None else attention_mask[a:b, ..., -n:]
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(
            query[a:b],
            key[a:b, :, -n:],
            value[a:b, :, -n:],
            attn_mask=mask,
            scale=scaling,
            enable_gqa=gqa,
        )
    return out.transpose(1, 2).contiguous(), None


def enable(model: PreTrainedModel) -> bool:
    """Switch an SDPA model to the bucketed decode attention; False if it uses another one."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    impl = getattr(model.config, "_attn_implementation", None)
    if impl == NAME:
        return True
    if impl != "sdpa":
        return False
    AttentionInterface.register(NAME, bucketed_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
