"""The ``math`` task: problems from a local JSONL or Parquet file, integer answers.

Each row holds the problem text (column ``task.prompt_key``) and the answer
(``task.answer_key``: an int, or text such as ``"42"``, ``"1,234"``,
``"#### 42"``, ``"\\boxed{42}"``). The prompt is the model's chat template
applied to ``[system?, user: problem]`` with the generation prompt, or (``task.prompt_format
= "raw"``, or ``"auto"`` for a tokenizer without a chat template, such as the tiny default
model's) the text itself after the model's BOS token. The reward
is 1 when the response's final answer — the last ``\\boxed{...}``, else the
number after the last ``####``, else the last number in the text — normalised
to an integer equals the row's answer, else 0.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncrl.config import MathTaskConfig
from asyncrl.core import Sample
from asyncrl.tasks.text import ChatTokenizer

__all__ = ["MathTask", "extract_answer", "load_rows", "normalize_int"]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")


def normalize_int(text: Any) -> int | None:
    """An integer from ``text`` (``" $1,234.00 "`` -> 1234), or None if it is not one."""
    if isinstance(text, bool):
        return None
    if isinstance(text, int):
        return text
    if isinstance(text, float):
        return int(text) if text.is_integer() else None
    s = str(text).strip().strip("$").replace(",", "").replace(" ", "").rstrip(".")
    s = s.removeprefix("\\$").removesuffix("\\%").removesuffix("%")
    try:
        value = float(s)
    except ValueError:
        return None
    return int(value) if value.is_integer() else None


def extract_answer(text: str) -> int | None:
    """The final integer answer in a response or an answer field (see the module doc)."""
    boxed = _BOXED.findall(text)
    if boxed:
        return normalize_int(boxed[-1])
    if "####" in text:
        tail = text.rsplit("####", 1)[1]
        found = _NUMBER.findall(tail)
        return normalize_int(found[0]) if found else None
    found = _NUMBER.findall(text)
    return normalize_int(found[-1]) if found else None


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a local ``.jsonl`` (one JSON object per line) or ``.parquet`` file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"task.path {str(p)!r} is not a file")
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError("reading Parquet needs pyarrow: pip install pyarrow") from None
        return pq.read_table(p).to_pylist()
    if p.suffix not in (".jsonl", ".json"):
        raise ValueError(f"task.path {str(p)!r}: expected a .jsonl or .parquet file")
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}:{n}: not a JSON object: {exc}") from None
    return rows


class MathTask:
    """Integer-answer problems; see the module doc. ``samples()`` cycles the rows forever."""

    def __init__(self, cfg: MathTaskConfig, model_path: str):
        if not cfg.path:
            raise ValueError("task.name='math' needs task.path (a local .jsonl or .parquet file)")
        self.tok = ChatTokenizer(model_path)
        self.seed = cfg.seed
        self.shuffle = cfg.shuffle
        self.items: list[tuple[list[int], int]] = []
        for i, row in enumerate(load_rows(cfg.path)):
            if cfg.prompt_key not in row or cfg.answer_key not in row:
                raise ValueError(
                    f"{cfg.path} row {i}: needs keys {cfg.prompt_key!r} (task.prompt_key) and "
                    f"{cfg.answer_key!r} (task.answer_key); it has {sorted(row)}"
                )
            raw = row[cfg.answer_key]
            answer = normalize_int(raw) if not isinstance(raw, str) else extract_answer(raw)
            if answer is None:
                raise ValueError(f"{cfg.path} row {i}: answer {raw!r} is not an integer")
            self.items.append((self._prompt(cfg, str(row[cfg.prompt_key])), answer))
        if not self.items:
            raise ValueError(f"{cfg.path} holds no rows")

    def _prompt(self, cfg: MathTaskConfig, problem: str) -> list[int]:
        """The prompt's ids as ``task.prompt_format`` says (``auto``: chat if the tokenizer
        has a chat template)."""
        if cfg.prompt_format == "chat" or (cfg.prompt_format == "auto" and self.tok.template):
            messages = [{"role": "user", "content": problem}]
            if cfg.system_prompt:
                messages.insert(0, {"role": "system", "content": cfg.system_prompt})
            return self.tok.chat_ids(messages)
        text = f"{cfg.system_prompt} {problem}" if cfg.system_prompt else problem
        return self.tok.raw_ids(text)

    def samples(self) -> Iterator[Sample]:
        rng = random.Random(self.seed)
        order = list(range(len(self.items)))
        i = 0
        while True:
            if self.shuffle:
                rng.shuffle(order)
            for k in order:
                ids, answer = self.items[k]
                yield Sample(prompt_ids=ids, answer=answer, id=i)
                i += 1

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def reward(self, sample: Sample, response_ids: list[int]) -> float:
        got = extract_answer(self.decode(response_ids))
        return 1.0 if got is not None and got == sample.answer else 0.0
