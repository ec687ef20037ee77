"""The one forward both stand-ins' engines run (SGLang's ``sglang/standin.py``, vLLM's
``vllm/standin.py``): a batch of token sequences, left-padded, through a Hugging Face causal
LM; each family keeps its own scheduling, sampling and wire."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["last_logits"]


def last_logits(model: Any, seqs: list[list[int]]) -> torch.Tensor:
    """The last position's logits of each sequence of ``seqs`` (left-padded, positions from 0
    at each sequence's first token), without gradients."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
