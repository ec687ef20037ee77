"""What several benchmarks do the same way: random-init Qwen2 models from a few sizes
(no download) and the ``--json PATH`` results file. Imports torch and transformers only
when a model is built."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["qwen2", "save_random_qwen2", "write_json"]


_SIZE = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


def qwen2(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, **more: Any
) -> dict[str, Any]:
    """``Qwen2Config`` keyword arguments of one size; ``more``: further fields as they are."""
    size = (hidden, intermediate, layers, heads, kv_heads, vocab)
    return {**dict(zip(_SIZE, size, strict=True)), **more}


def save_random_qwen2(out: Path, config: dict[str, Any], **save: Any) -> None:
    """A Qwen2 of ``config`` (:func:`qwen2`), initialised from seed 0, saved in Hugging Face
    format to ``out`` (``save``: ``save_pretrained``'s options)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**config)).save_pretrained(out, **save)


def write_json(path: str | None, result: Any) -> None:
    """``result`` as indented JSON at ``path`` (a bench's ``--json``); nothing when unset."""
    if path:
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
