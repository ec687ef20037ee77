"""The ``agent`` task's data path: ``task.path`` / ``task.sources`` read through
``asyncrl.tasks.data`` (JSONL, Parquet, a ``datasets`` folder, sources mixed by weight, the
same row/column errors) into the samples the agent gets."""

from __future__ import annotations

import collections
import itertools
import json
from pathlib import Path

import msgspec
import pytest

from asyncrl.config import AgentTaskConfig, load_config
from asyncrl.config.task import DataSource
from asyncrl.gateway.agent import AgentSample, agent_samples, check_agent
from asyncrl.task_factory import check_task
from tests.tasks.test_data import _hf, _jsonl, _parquet

AGENT = "examples/agents.py:weather_agent"
CHAT = [{"role": "user", "content": "Reverse: 1 2"}]
ROWS = [  # one schema for all rows (a Parquet file's columns are the table's)
    {"prompt": "Reverse: 3 8 1", "messages": None, "answer": "1 8 3", "level": 1},
    {"prompt": "", "messages": CHAT, "answer": "2 1", "level": 2},
]


def _cfg(task: AgentTaskConfig):  # type: ignore[no-untyped-def]
    return msgspec.structs.replace(load_config(None, ["--task.name=agent"]), task=task)


@pytest.mark.parametrize("write", [_jsonl, _parquet, _hf], ids=["jsonl", "parquet", "datasets"])
def test_each_format_gives_the_agent_the_same_samples(write, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    suffix = {"_jsonl": ".jsonl", "_parquet": ".parquet", "_hf": ""}[write.__name__]
    path = write(tmp_path / f"rev{suffix}", ROWS)
    task = AgentTaskConfig(agent=AGENT, path=str(path), extra_keys=["level"])
    check_task(_cfg(task))
    got = list(itertools.islice(agent_samples(_cfg(task)), 5))
    # the rows in file order, again and again (unshuffled, as before), ids counting up
    assert [s.id for s in got] == [0, 1, 2, 3, 4]
    assert [s.prompt for s in got[:2]] == ["Reverse: 3 8 1", ""]
    assert got[1].messages == CHAT and got[0].messages == []
    assert [s.answer for s in got] == ["1 8 3", "2 1"] * 2 + ["1 8 3"]
    assert [s.fields for s in got[:2]] == [{"level": 1}, {"level": 2}]
    assert all(isinstance(s, AgentSample) and s.source == "rev" for s in got)
    # what the agent command gets (ASYNCRL_SAMPLE) and a checkpoint restores
    assert msgspec.json.decode(msgspec.json.encode(got[1]), type=AgentSample) == got[1]


def test_agent_sources_mix_by_weight_with_their_own_columns(tmp_path: Path) -> None:
    a = _jsonl(tmp_path / "a.jsonl", [{"prompt": "A", "answer": 1}] * 3)
    b = _parquet(tmp_path / "b.parquet", [{"question": "B", "solution": 2}] * 5)
    sources = [
        {"path": str(a), "weight": 3},
        {"path": str(b), "name": "bee", "prompt_key": "question", "answer_key": "solution"},
    ]
    cfg = load_config(
        None,
        ["--task.name=agent", f"--task.agent={AGENT}", f"--task.sources={json.dumps(sources)}"],
    )
    check_task(cfg)
    got = list(itertools.islice(agent_samples(cfg), 4000))
    count = collections.Counter(s.source for s in got)
    assert set(count) == {"a", "bee"} and 0.72 < count["a"] / 4000 < 0.78
    assert all((s.prompt, s.answer) == (("A", 1) if s.source == "a" else ("B", 2)) for s in got)
    assert list(itertools.islice(agent_samples(cfg), 50)) == got[:50]  # seeded
    with pytest.raises(ValueError, match=r"task\.path and task\.sources are exclusive"):
        AgentTaskConfig(path=str(a), sources=[DataSource(path=str(b))])


@pytest.mark.parametrize(
    ("row", "said"),
    [
        ({"answer": 1}, r"bad\.jsonl row 1, column 'prompt': missing or empty"),
        ({"messages": "hi"}, r"bad\.jsonl row 1, column 'messages': not a list"),
        ({"prompt": "x"}, r"bad\.jsonl row 1, column 'level': missing \(task\.extra_keys\)"),
    ],
)
def test_an_unusable_agent_row_is_named_by_file_row_and_column(
    row: dict, said: str, tmp_path: Path
) -> None:
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "level": 0}, row])
    task = AgentTaskConfig(agent=AGENT, path=str(path), extra_keys=["level"])
    with pytest.raises(ValueError, match=said):
        agent_samples(_cfg(task))


def test_agent_preflight_names_a_missing_source_and_takes_a_folder(tmp_path: Path) -> None:
    folder = _hf(tmp_path / "ds", ROWS)
    check_agent(AgentTaskConfig(agent=AGENT, path=str(folder)))
    bad = AgentTaskConfig(agent=AGENT, sources=[DataSource(path=str(folder)), DataSource(path="x")])
    with pytest.raises(ValueError, match=r"task\.sources 'x' is not a file \(task\.name='agent'\)"):
        check_agent(bad)
    # no data: the built-in weather task, as before
    first = next(agent_samples(_cfg(AgentTaskConfig(agent=AGENT))))
    assert first.prompt.startswith("What is the weather in ") and first.source == ""
