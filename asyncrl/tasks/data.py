"""Data as it comes: rows from JSONL, Parquet or a ``datasets`` folder, several sources mixed.

:func:`load_rows` reads one source (``task.path`` or one of ``task.sources``): a ``.jsonl``
file (one JSON object per line), a ``.parquet`` file (pyarrow) or a folder written by Hugging
Face ``datasets``' ``save_to_disk`` (``datasets.load_from_disk``, imported only then).
:func:`mix` interleaves several sources' rows by their mixing weights, seeded, each source
cycling its own (optionally shuffled) order. A sample of a file-backed task is a
:class:`DataSample`: a :class:`~asyncrl.core.Sample` that also names its source and carries
the row's extra columns to the reward.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from asyncrl.core import Sample

__all__ = ["DataSample", "chat_messages", "load_rows", "mix", "row_error"]


class DataSample(Sample, frozen=True):
    """A sample of a file-backed task: ``source`` is its source's name
    (:attr:`~asyncrl.config.task.DataSource.label`), ``fields`` the row's ``task.extra_keys``
    columns (column -> value), for the reward."""

    source: str = ""
    fields: dict[str, Any] = {}


def row_error(path: str, row: int, column: str, why: str) -> ValueError:
    """The one form of an unusable row's error: file, row (0-based) and column."""
    return ValueError(f"{path} row {row}, column {column!r}: {why}")


def chat_messages(path: str, row: int, column: str, value: Any) -> list[dict[str, Any]]:
    """A row's chat column as messages: a list of ``{role, content}`` objects (else the row
    error naming ``path``, ``row`` and ``column``)."""
    ok = (
        isinstance(value, list | tuple)
        and value
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )
    if not ok:
        raise row_error(
            path, row, column, f"not a list of {{role, content}} messages: {value!r:.80}"
        )
    return [dict(m) for m in value]


def load_rows(path: str | Path, key: str = "task.path") -> list[dict[str, Any]]:
    """Rows of a local ``.jsonl`` / ``.parquet`` file or a ``save_to_disk`` folder; errors
    name ``key``, the config key that gave ``path``."""
    p = Path(path)
    if p.is_dir():
        return _load_dataset_dir(p, key)
    if not p.is_file():
        raise ValueError(f"{key} {str(p)!r} is not a file or a datasets folder")
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError("reading Parquet needs pyarrow: pip install pyarrow") from None
        return pq.read_table(p).to_pylist()
    if p.suffix not in (".jsonl", ".json"):
        raise ValueError(
            f"{key} {str(p)!r}: expected a .jsonl or .parquet file or a folder written by "
            "datasets' save_to_disk"
        )
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}:{n}: not a JSON object: {exc}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{p}:{n}: not a JSON object but {type(row).__name__}")
            rows.append(row)
    return rows


def _load_dataset_dir(p: Path, key: str) -> list[dict[str, Any]]:
    try:
        import datasets  # type: ignore[import-untyped]
    except ImportError:
        raise ValueError(
            f"{key} {str(p)!r} is a folder: reading a datasets save_to_disk folder needs the "
            "datasets package (pip install datasets)"
        ) from None
    try:
        ds = datasets.load_from_disk(str(p))
    except FileNotFoundError as exc:
        raise ValueError(f"{key} {str(p)!r}: not a datasets save_to_disk folder ({exc})") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = ", ".join(f"{p}/{s}" for s in ds)
        raise ValueError(f"{key} {str(p)!r} holds several splits: name one ({splits})")
    return list(ds.to_list())


def mix(
    sizes: Sequence[int], weights: Sequence[float], seed: int, shuffle: bool
) -> Iterator[tuple[int, int]]:
    """Forever: ``(source, row)`` pairs, the source drawn with probability its weight over the
    sum (one source: always it), each source visiting its ``sizes[j]`` rows in a seeded
    random order each pass (``shuffle``) or in order. Source ``j``'s order is seeded
    ``seed + j``: one source's stream is the one-file stream of earlier versions."""
    rngs = [random.Random(seed + j) for j in range(len(sizes))]
    orders = [list(range(n)) for n in sizes]
    pos = [n for n in sizes]  # each source starts a pass at its first draw
    pick = random.Random(f"{seed}/mix")
    total = sum(weights)
    cum = [sum(weights[: j + 1]) / total for j in range(len(weights))]
    while True:
        j = 0
        if len(sizes) > 1:
            u = pick.random()
            j = next((i for i, c in enumerate(cum) if u < c), len(cum) - 1)
        if pos[j] == sizes[j]:
            if shuffle:
                rngs[j].shuffle(orders[j])
            pos[j] = 0
        yield j, orders[j][pos[j]]
        pos[j] += 1
