"""The ``math`` task: problems from local data (JSONL, Parquet, a ``datasets`` folder; one
``task.path`` or several ``task.sources`` mixed by weight: :mod:`asyncrl.tasks.data`),
integer answers.

Each row holds the problem text (column ``task.prompt_key``; or a chat, ``task.messages_key``)
and the answer
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

import re
from collections.abc import Iterator
from typing import Any

from asyncrl.config import MathTaskConfig
from asyncrl.config.task import DataSource
from asyncrl.core import Sample
from asyncrl.tasks.data import DataSample, chat_messages, load_rows, mix, row_error
from asyncrl.tasks.text import ChatTokenizer

__all__ = ["MathTask", "extract_answer", "load_rows", "normalize_int"]  # load_rows: tasks.data

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


class MathTask:
    """Integer-answer problems; see the module doc. ``samples()`` draws rows forever from the
    task's sources (``task.path`` or ``task.sources``, mixed by weight:
    :func:`asyncrl.tasks.data.mix`), each a :class:`~asyncrl.tasks.data.DataSample` naming
    its source."""

    def __init__(self, cfg: MathTaskConfig, model_path: str):
        sources = cfg.all_sources()
        if not sources:
            raise ValueError(
                "task.name='math' needs task.path (a local .jsonl or .parquet file or a "
                "datasets folder) or task.sources"
            )
        self.tok = ChatTokenizer(model_path)
        self.cfg = cfg
        self.labels = [s.label for s in sources]
        if len(set(self.labels)) < len(self.labels):
            raise ValueError(f"task.sources: two sources share a name ({self.labels}): set name")
        self.weights = [s.weight for s in sources]
        self.items = [self._items(s) for s in sources]

    def _items(self, src: DataSource) -> list[tuple[list[int], int, dict[str, Any]]]:
        cfg = self.cfg
        prompt_key = src.prompt_key or cfg.prompt_key
        messages_key = src.messages_key or cfg.messages_key
        answer_key = src.answer_key or cfg.answer_key
        items = []
        for i, row in enumerate(load_rows(src.path)):
            if prompt_key in row:
                prompt = self._prompt(str(row[prompt_key]))
            elif messages_key in row:
                prompt = self._chat(chat_messages(src.path, i, messages_key, row[messages_key]))
            else:
                raise row_error(
                    src.path, i, prompt_key,
                    f"missing (nor a {messages_key!r} chat): task.prompt_key / "
                    f"task.messages_key; the row has {sorted(row)}",
                )  # fmt: skip
            if answer_key not in row:
                raise row_error(
                    src.path, i, answer_key, f"missing (task.answer_key); the row has {sorted(row)}"
                )
            raw = row[answer_key]
            answer = normalize_int(raw) if not isinstance(raw, str) else extract_answer(raw)
            if answer is None:
                raise row_error(src.path, i, answer_key, f"answer {raw!r} is not an integer")
            missing = [k for k in cfg.extra_keys if k not in row]
            if missing:
                raise row_error(src.path, i, missing[0], "missing (task.extra_keys)")
            items.append((prompt, answer, {k: row[k] for k in cfg.extra_keys}))
        if not items:
            raise ValueError(f"{src.path} holds no rows")
        return items

    def _chat_format(self) -> bool:
        fmt = self.cfg.prompt_format
        return fmt == "chat" or (fmt == "auto" and bool(self.tok.template))

    def _prompt(self, problem: str) -> list[int]:
        """The prompt's ids as ``task.prompt_format`` says (``auto``: chat if the tokenizer
        has a chat template)."""
        return self._chat([{"role": "user", "content": problem}])

    def _chat(self, messages: list[dict[str, Any]]) -> list[int]:
        system = self.cfg.system_prompt
        if self._chat_format():
            if system and not any(m.get("role") == "system" for m in messages):
                messages = [{"role": "system", "content": system}, *messages]
            return self.tok.chat_ids(messages)
        text = " ".join(str(m.get("content", "")) for m in messages)
        return self.tok.raw_ids(f"{system} {text}" if system else text)

    def samples(self) -> Iterator[DataSample]:
        sizes = [len(items) for items in self.items]
        stream = mix(sizes, self.weights, self.cfg.seed, self.cfg.shuffle)
        for i, (j, k) in enumerate(stream):
            ids, answer, fields = self.items[j][k]
            yield DataSample(
                prompt_ids=ids, answer=answer, id=i, source=self.labels[j], fields=fields
            )

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def reward(self, sample: Sample, response_ids: list[int]) -> float:
        got = extract_answer(self.decode(response_ids))
        return 1.0 if got is not None and got == sample.answer else 0.0
