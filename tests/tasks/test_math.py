"""The math task (JSONL rows, chat template, integer answers) and custom reward functions."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from asyncrl.config import MathTaskConfig, ReverseTaskConfig, RunConfig, load_config
from asyncrl.controllers.episode import call_reward
from asyncrl.core import Sample
from asyncrl.tasks import make_task
from asyncrl.tasks.base import load_reward_fn
from asyncrl.tasks.math import extract_answer, load_rows, normalize_int

TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}+ {% endif %}"
    "{{ bos_token }} {{ m['content'] }} ={% endfor %}"
)


@pytest.mark.parametrize(
    ("text", "want"),
    [(" $1,234.00 ", 1234), ("-7", -7), ("3.5", None), ("abc", None), (12, 12), (True, None)],
)
def test_normalize_int(text: object, want: int | None) -> None:
    assert normalize_int(text) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("so the answer is \\boxed{1,000}.", 1000),
        ("2 + 2 = 4, then \\boxed{5} and \\boxed{6}", 6),
        ("work 12 then #### 42", 42),
        ("first 3 then 17.", 17),
        ("no number", None),
    ],
)
def test_extract_answer(text: str, want: int | None) -> None:
    assert extract_answer(text) == want


@pytest.fixture
def chat_model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model's tokenizer with a chat template added."""
    out = tmp_path / "chat"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    conf = json.loads((out / "tokenizer_config.json").read_text())
    conf["chat_template"] = TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(conf))
    return out


def _rows(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    rows = [{"question": "1 + 2", "answer": "#### 3"}, {"question": "4 + 4", "answer": 8}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_math_task_prompts_and_reward(chat_model_dir: Path, tmp_path: Path) -> None:
    cfg = MathTaskConfig(path=str(_rows(tmp_path)), shuffle=False, system_prompt="9")
    task = make_task(cfg, str(chat_model_dir))
    vocab = json.loads((chat_model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    it = task.samples()
    first, second, third = next(it), next(it), next(it)
    # system turn renders as "+ <s> 9 =", the user turn as "<s> 1 + 2 ="
    want = ["+", "<s>", "9", "=", "<s>", "1", "+", "2", "="]
    assert first.prompt_ids == [vocab[w] for w in want]
    assert (first.answer, second.answer, third.answer) == (3, 8, 3)
    assert task.reward(first, [vocab["3"], vocab["</s>"]]) == 1.0
    assert task.reward(first, [vocab["4"]]) == 0.0
    assert task.reward(second, [vocab["8"]]) == 1.0


def test_math_on_the_tiny_default_model_is_a_raw_prompt_within_its_context(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The tiny default model has no chat template: ``prompt_format = "auto"`` makes a raw
    prompt (BOS, the text), and the default budget fits its 64-token context, so the preflight
    passes (``asyncrl run --task.name=math --task.path=F`` runs on it: tests/test_run.py)."""
    from asyncrl.preflight import preflight
    from asyncrl.tasks.tiny_model import TINY_CONTEXT

    rows = _rows(tmp_path)
    task = make_task(MathTaskConfig(path=str(rows), shuffle=False), str(tiny_model_dir))
    vocab = json.loads((tiny_model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    first = next(task.samples())
    assert first.prompt_ids == [vocab[w] for w in ["<s>", "1", "+", "2"]]
    cfg = load_config(None, ["--task.name=math", f"--task.path={rows}"])
    assert len(first.prompt_ids) + cfg.generation_budget() <= TINY_CONTEXT
    preflight(cfg)  # no "exceed the engines' context"
    with pytest.raises(ValueError, match=r"task\.max_new_tokens: at least 1 prompt \+ 512"):
        preflight(load_config(None, ["--task.name=math", f"--task.path={rows}",
                                     "--task.max_new_tokens=512"]))  # fmt: skip


def test_math_task_errors(chat_model_dir: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"task\.path"):
        make_task(MathTaskConfig(), str(chat_model_dir))
    rows = _rows(tmp_path)
    with pytest.raises(ValueError, match=r"no chat template.*task\.prompt_format='raw'"):
        chat = MathTaskConfig(path=str(rows), prompt_format="chat")
        make_task(chat, str(tiny_model_dir))
    with pytest.raises(ValueError, match=r"task\.prompt_key"):
        make_task(MathTaskConfig(path=str(rows), prompt_key="q"), str(chat_model_dir))
    bad = tmp_path / "bad.csv"
    bad.write_text("x")
    with pytest.raises(ValueError, match=r"jsonl or \.parquet"):
        load_rows(bad)


def test_parquet_rows(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"question": ["1 + 1"], "answer": [2]}), path)
    assert load_rows(path) == [{"question": "1 + 1", "answer": 2}]


REWARD_MODULE = """
def exact(sample, response_ids, *, text):
    return 1.0 if text.split()[:1] == ["7"] else 0.0

async def by_length(sample, response_ids):
    return len(response_ids) / 10

def legacy(sample, response_ids, response_text):
    return 1.0 if response_text.split()[:1] == ["7"] else 0.0

def wrong(sample):
    return 1.0
"""


async def test_custom_reward_from_config(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``task.reward_fn`` has the one reward signature ``fn(sample, response_ids)`` (a
    keyword-only ``text`` gets the decoded response); the old ``(sample, ids, text)`` form
    still works, with a deprecation warning showing the new one; anything else is refused."""
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    vocab = json.loads((tiny_model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    task = make_task(ReverseTaskConfig(reward_fn="my_rewards:exact"), str(tiny_model_dir))
    sample = next(task.samples())
    assert await call_reward(task.reward, sample, [vocab["7"], vocab["1"]]) == 1.0
    assert await call_reward(task.reward, sample, [vocab["1"]]) == 0.0
    task = make_task(ReverseTaskConfig(reward_fn="my_rewards.by_length"), str(tiny_model_dir))
    assert await call_reward(task.reward, sample, [1, 2, 3]) == pytest.approx(0.3)
    with pytest.warns(DeprecationWarning, match=r"def legacy\(sample, response_ids, \*, text\)"):
        task = make_task(ReverseTaskConfig(reward_fn="my_rewards:legacy"), str(tiny_model_dir))
    assert await call_reward(task.reward, sample, [vocab["7"]]) == 1.0
    with pytest.raises(ValueError, match=r"my_rewards.wrong\(sample\) cannot be called as"):
        make_task(ReverseTaskConfig(reward_fn="my_rewards:wrong"), str(tiny_model_dir))
    sys.modules.pop("my_rewards", None)


def test_reward_fn_errors() -> None:
    with pytest.raises(ValueError, match=r"package\.module:function"):
        load_reward_fn("nodots")
    with pytest.raises(ValueError, match="cannot import"):
        load_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no function"):
        load_reward_fn("json:no_such_function")


def test_reverse_task_unchanged(tiny_model_dir: Path) -> None:
    task = make_task(ReverseTaskConfig(), str(tiny_model_dir))
    vocab = json.loads((tiny_model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    s = next(task.samples())
    n = ReverseTaskConfig().num_digits
    assert isinstance(s, Sample) and len(s.answer) == n
    assert task.reward(s, [*s.answer, vocab["</s>"]]) == 1.0


def test_config_keys() -> None:
    cfg = load_config(None, ["--algo.name=ppo", "--task.name=math", "--task.max_new_tokens=64"])
    assert cfg.algo.name == "ppo" and cfg.generation_budget() == 64
    assert load_config(None, ["--task.name=math"]).generation_budget() == 16  # tiny default
    real = load_config(None, ["--task.name=math", "--model.path=/m"])
    assert real.generation_budget() == 512
    assert RunConfig().generation_budget() == RunConfig().task.num_digits + 1
    assert load_config(None, ["--rollout.max_new_tokens=9"]).generation_budget() == 9
    with pytest.raises(ValueError, match="allowed values"):
        load_config(None, ["--algo.name=dpo"])
    with pytest.raises(ValueError, match=r"algo\.lam"):
        load_config(None, ["--algo.lam=1.5"])
    with pytest.raises(ValueError, match=r"algo\.num_minibatches"):
        load_config(None, ["--algo.num_minibatches=0"])


def test_words_the_vocabulary_cannot_spell_are_an_error(tiny_model_dir: Path) -> None:
    from asyncrl.tasks.text import ChatTokenizer

    tok = ChatTokenizer(tiny_model_dir)
    assert tok.encode("1 + 4 =") == tok.encode("1 +  4 =")  # spelt: fine
    with pytest.raises(ValueError, match=r"cannot spell \['1\+4='\]"):
        tok.encode("1+4=")  # one unknown word: it would have become <pad>
    assert tok.encode("<pad> 1")[0] == tok.tokenizer.token_to_id("<pad>")  # said on purpose
