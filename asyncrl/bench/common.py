"""What several benchmarks do the same way: random-init Qwen2 models from a few sizes
(no download) and the ``--json PATH`` results file. Imports torch and transformers only
when a model is built."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.procs import Proc

__all__ = ["qwen2", "save_random_qwen2", "start", "write_json"]


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


def start(args: Sequence[str], log: Path | None, env: dict[str, str]) -> Proc:
    """``python ARGS`` for a bench (its engine, its run), ending with this process: forked
    from the shared fork server when ``ASYNCRL_FORK_SERVER`` names one (a sweep's, a test
    session's: no imports to repeat), else a fresh process (:func:`asyncrl.procs.spawn`).
    A :data:`asyncrl.procs.Spawner`."""
    from asyncrl.forkserver import spawn_shared

    return spawn_shared(args, log, env, die_with_parent=True)
