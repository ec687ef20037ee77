"""Data as it comes: JSONL, Parquet and datasets folders, column mappings, mixed sources."""

from __future__ import annotations

import collections
import itertools
import json
from pathlib import Path

import msgspec
import pytest

from asyncrl.config import MathTaskConfig, load_config
from asyncrl.config.task import DataSource
from asyncrl.task_factory import build_task, check_task
from asyncrl.tasks import make_task
from asyncrl.tasks.data import DataSample, load_rows, mix

ROWS = [
    {"problem": "1 + 2", "solution": "#### 3", "level": 1},
    {"problem": "4 + 4", "solution": "8", "level": 2},
]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _hf(path: Path, rows: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("write", [_jsonl, _parquet, _hf], ids=["jsonl", "parquet", "datasets"])
def test_each_format_reads_the_same_rows_into_samples(
    write, tiny_model_dir: Path, tmp_path: Path
) -> None:
    suffix = {"_jsonl": ".jsonl", "_parquet": ".parquet", "_hf": ""}[write.__name__]
    path = write(tmp_path / f"algebra{suffix}", ROWS)
    assert load_rows(path) == ROWS
    cfg = MathTaskConfig(
        path=str(path), prompt_key="problem", answer_key="solution", extra_keys=["level"],
        shuffle=False,
    )  # fmt: skip
    check_task(_run(cfg))
    task = make_task(cfg, str(tiny_model_dir))
    got = list(itertools.islice(task.samples(), 3))
    assert [s.answer for s in got] == [3, 8, 3]
    assert all(isinstance(s, DataSample) and s.source == "algebra" for s in got)
    assert [s.fields for s in got] == [{"level": 1}, {"level": 2}, {"level": 1}]
    assert got[0].prompt_ids == got[2].prompt_ids != got[1].prompt_ids


def _run(task: MathTaskConfig):
    return msgspec.structs.replace(load_config(None, []), task=task)


def test_a_datasets_folder_of_several_splits_asks_for_one(tmp_path: Path) -> None:
    import datasets

    d = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)})
    d.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"several splits: name one \(.*dd/train\)"):
        load_rows(tmp_path / "dd")
    assert load_rows(tmp_path / "dd" / "train") == ROWS


def test_a_messages_column_is_rendered_as_a_chat(tiny_model_dir: Path, tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": "1 + 2"}], "answer": 3}]
    _jsonl(tmp_path / "c.jsonl", rows)
    plain = _jsonl(tmp_path / "p.jsonl", [{"question": "1 + 2", "answer": 3}])
    flat = make_task(MathTaskConfig(path=str(plain)), str(tiny_model_dir))
    chat = make_task(MathTaskConfig(path=str(tmp_path / "c.jsonl")), str(tiny_model_dir))
    # the tiny model has no chat template: raw, the contents joined, as a plain prompt
    assert next(chat.samples()).prompt_ids == next(flat.samples()).prompt_ids


@pytest.mark.parametrize(
    ("row", "said"),
    [
        ({"answer": 1}, r"bad\.jsonl row 1, column 'question': missing"),
        ({"question": "1", "answer": "seven"}, r"bad\.jsonl row 1, column 'answer': .*not an int"),
        ({"question": "1"}, r"bad\.jsonl row 1, column 'answer': missing"),
        ({"messages": "hi", "answer": 1}, r"bad\.jsonl row 1, column 'messages': not a list"),
        ({"question": "1", "answer": 1}, r"bad\.jsonl row 1, column 'level': missing"),
    ],
)
def test_an_unusable_row_is_named_by_file_row_and_column(
    row: dict, said: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    path = _jsonl(tmp_path / "bad.jsonl", [{"question": "2", "answer": 2, "level": 0}, row])
    with pytest.raises(ValueError, match=said):
        make_task(MathTaskConfig(path=str(path), extra_keys=["level"]), str(tiny_model_dir))


def test_sources_mix_by_weight_each_with_its_own_columns(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    a = _jsonl(tmp_path / "a.jsonl", [{"question": "1", "answer": 1}] * 3)
    b = _parquet(tmp_path / "b.parquet", [{"problem": "2", "solution": 2}] * 5)
    cfg = load_config(None, [
        "--task.name=math",
        "--task.sources=" + json.dumps([
            {"path": str(a), "weight": 3},
            {"path": str(b), "name": "bee", "prompt_key": "problem", "answer_key": "solution"},
        ]),
    ]).task  # fmt: skip
    assert isinstance(cfg, MathTaskConfig) and cfg.sources[0].weight == 3
    task = make_task(cfg, str(tiny_model_dir))
    got = list(itertools.islice(task.samples(), 4000))
    count = collections.Counter(s.source for s in got)
    assert set(count) == {"a", "bee"} and 0.72 < count["a"] / 4000 < 0.78
    assert all(s.answer == (1 if s.source == "a" else 2) for s in got)
    # the same seed, the same stream; restored from a checkpoint as DataSample
    again = list(itertools.islice(make_task(cfg, str(tiny_model_dir)).samples(), 50))
    assert again == got[:50]
    built = build_task(_run(cfg), str(tiny_model_dir))
    assert built.sample_type is DataSample
    wire = msgspec.msgpack.encode(got[0])
    assert msgspec.msgpack.decode(wire, type=DataSample) == got[0]


def test_one_source_is_the_one_file_stream_and_path_and_sources_exclude() -> None:
    single = list(itertools.islice(mix([5], [1.0], 7, True), 15))
    import random

    rng, order, want = random.Random(7), list(range(5)), []
    for _ in range(3):
        rng.shuffle(order)
        want += [(0, k) for k in order]
    assert single == want
    with pytest.raises(ValueError, match=r"task\.path and task\.sources are exclusive"):
        MathTaskConfig(path="a.jsonl", sources=[DataSource(path="b.jsonl")])


def test_preflight_names_a_missing_source(tmp_path: Path) -> None:
    a = _jsonl(tmp_path / "a.jsonl", ROWS)
    cfg = MathTaskConfig(sources=[DataSource(path=str(a)), DataSource(path="nope.parquet")])
    with pytest.raises(ValueError, match=r"task\.sources 'nope\.parquet' is not a file or folder"):
        check_task(_run(cfg))
    check_task(_run(MathTaskConfig(sources=[DataSource(path=str(a))])))
