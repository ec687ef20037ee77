"""The default model: a tiny Qwen2-architecture causal LM with a digit tokenizer, made locally.

Written once in Hugging Face format (``config.json``, ``model.safetensors``,
``tokenizer.json``, ...) and then loaded through the ordinary
``from_pretrained(local_dir)`` path, exactly as a real model is. No download.
``python -m asyncrl.tasks.tiny_model --out DIR`` builds it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["TINY_CONTEXT", "TINY_VERSION", "TINY_VOCAB", "default_model_dir", "ensure_tiny_model"]

TINY_VERSION = "tiny-qwen2-digits-v1"
TINY_CONTEXT = 64
"""The tiny model's context length (``max_position_embeddings``): prompt + response tokens."""
TINY_ARCH: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}
"""The tiny models' shape (``Qwen2Config`` keywords), the digits model's and the chat
model's (``asyncrl.tasks.tiny_chat_model``)."""
SPECIAL = ["<pad>", "<s>", "</s>"]
WORDS = [*SPECIAL, *(str(d) for d in range(10)), "=", "+"]
TINY_VOCAB: tuple[str, ...] = tuple(WORDS)
"""The tiny model's vocabulary: the token id of a word is its index (``<pad>`` 0, ``<s>`` 1,
``</s>`` 2, the digits ``0``..``9`` 3..12, ``=`` 13, ``+`` 14)."""


def default_model_dir() -> Path:
    root = os.environ.get("ASYNCRL_CACHE") or Path.home() / ".cache" / "asyncrl"
    return Path(root) / "models" / TINY_VERSION


def _build(out: Path, seed: int) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<pad>",
    )
    config = Qwen2Config(
        **TINY_ARCH,
        vocab_size=len(vocab),
        max_position_embeddings=TINY_CONTEXT,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = vocab["</s>"]
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)


def build_once(path: Path, build: Callable[[Path, int], None], seed: int) -> Path:
    """Run ``build(folder, seed)`` into a temporary folder beside ``path`` and rename it to
    ``path``, unless a model (config.json and tokenizer.json) is already there. The rename is
    atomic, so concurrent builders race harmlessly: one wins, the others' copies are removed."""
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".building-"))
    try:
        build(tmp, seed)
        try:
            tmp.rename(path)
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def ensure_tiny_model(path: Path | None = None, seed: int = 0) -> Path:
    """The tiny default model's Hugging Face folder: built at ``path`` (default
    ``~/.cache/asyncrl/models/`` or ``$ASYNCRL_CACHE``) unless it is already there, in a
    second or two, with no download; its vocabulary is :data:`TINY_VOCAB`."""
    return build_once(Path(path or default_model_dir()), _build, seed)


def build_main(
    description: str, ensure: Callable[[Path | None, int], Path], argv: list[str] | None
) -> None:
    """``python -m MODULE [--out DIR] [--seed N]``: build the model (once) with ``ensure``
    and print its folder."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(ensure(Path(args.out) if args.out else None, args.seed))


def main(argv: list[str] | None = None) -> None:
    build_main("build the tiny default model", ensure_tiny_model, argv)


if __name__ == "__main__":
    main()
