"""The gateway's incremental detokenizer on the tiny chat model's byte-level tokenizer:
the text it streams is always whole characters and a prefix of the full decode, and a
completion of n tokens costs O(n) decoding (the full re-decode per token was O(n^2))."""

from __future__ import annotations

from pathlib import Path

from asyncrl.gateway.chat import Detokenizer
from asyncrl.tasks.text import ChatTokenizer

TEXT = "Héllo wörld, 日本語 🙂🙂 naïve café — ok! " * 8


class CountingTokenizer(ChatTokenizer):
    """The real tokenizer, counting how many ids it was asked to decode."""

    decoded = 0

    def decode(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return super().decode(ids)


def test_incremental_text_is_whole_characters_and_linear(chat_model_dir: Path) -> None:
    tok = CountingTokenizer(chat_model_dir)
    ids = tok.encode(TEXT)
    full = tok.decode(ids)
    assert full == TEXT and len(ids) > 200
    assert any("\ufffd" in tok.decode(ids[:k]) for k in range(1, 40))  # characters split
    tok.decoded = 0
    d = Detokenizer(tok)
    for k in range(1, len(ids) + 1):
        text = d.update(ids[:k])
        assert "\ufffd" not in text and full.startswith(text)
    assert text == full
    assert tok.decoded <= 6 * len(ids)  # O(n): each id decoded a bounded number of times
