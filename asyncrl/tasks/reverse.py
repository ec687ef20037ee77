"""The default task: say the prompt's digits in reverse order.

Prompt ``<s> 3 1 4 =``; the right answer is ``4 1 3 </s>``. Reward is the
fraction of the n answer positions that hold the right digit (partial credit,
in [0, 1]); anything after the first ``</s>`` is ignored. A randomly initialised
model starts near chance (1/vocab per position), the reward is exact and cheap
to verify, and getting it right needs content-dependent attention to earlier
positions — the same machinery a real model uses — so it is a fair, quick test
that the whole loop (generation, log-probs, staleness, weight sync, loss) learns.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

from asyncrl.core import Sample

__all__ = ["ReverseTask"]

DIGITS = [str(d) for d in range(10)]


class ReverseTask:
    def __init__(self, vocab: dict[str, int], num_digits: int, seed: int, eos: str = "</s>"):
        missing = [t for t in [*DIGITS, "=", "<s>", eos] if t not in vocab]
        if missing:
            raise ValueError(f"tokenizer lacks tokens the reverse task needs: {missing}")
        self.vocab = vocab
        self.num_digits = num_digits
        self.seed = seed
        self.eos_id = vocab[eos]

    @classmethod
    def from_tokenizer_dir(cls, model_path: str, num_digits: int, seed: int) -> ReverseTask:
        from tokenizers import Tokenizer

        path = Path(model_path) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{path} not found: the reverse task needs the model's tokenizer.json")
        return cls(Tokenizer.from_file(str(path)).get_vocab(), num_digits, seed)

    def samples(self) -> Iterator[Sample]:
        rng = random.Random(self.seed)
        i = 0
        while True:
            digits = [rng.randrange(10) for _ in range(self.num_digits)]
            ids = [self.vocab["<s>"], *(self.vocab[str(d)] for d in digits), self.vocab["="]]
            answer = [self.vocab[str(d)] for d in reversed(digits)]
            yield Sample(prompt_ids=ids, answer=answer, id=i)
            i += 1

    def reward(self, sample: Sample, response_ids: list[int]) -> float:
        out = list(response_ids)
        if self.eos_id in out:
            out = out[: out.index(self.eos_id)]
        answer = sample.answer
        hits = sum(1 for a, b in zip(out, answer, strict=False) if a == b)
        return hits / len(answer)
