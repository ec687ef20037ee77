"""The task seam: one config type per task (tag ``task.name``) and one factory
(``asyncrl.task_factory.build_task``) that builds the run's episodes from it."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest

from asyncrl.config import RunConfig, TaskConfig, load_config, to_dict
from asyncrl.config import task as T
from asyncrl.core import Sample
from asyncrl.task_factory import BUILDERS, build_task

ROOT = Path(__file__).resolve().parents[2]

TYPES = {
    "reverse": T.ReverseTaskConfig,
    "math": T.MathTaskConfig,
    "agent": T.AgentTaskConfig,
    "longtail": T.LongTailTaskConfig,
    "agentic": T.AgenticTaskConfig,
}


@pytest.mark.parametrize("name", sorted(TYPES))
def test_the_tag_selects_the_type(tmp_path: Path, name: str) -> None:
    """``[task] name = NAME`` (TOML, as users write it) and ``--task.name=NAME`` decode to
    NAME's type, whose ``name`` is the tag; config.json records it and resumes as the same."""
    f = tmp_path / "c.toml"
    f.write_text(f'[task]\nname = "{name}"\nseed = 7\n')
    for cfg in (load_config(f), load_config(None, [f"--task.name={name}", "--task.seed=7"])):
        assert type(cfg.task) is TYPES[name] and cfg.task.name == name and cfg.task.seed == 7
        tree = msgspec.json.decode(msgspec.json.encode(to_dict(cfg)))
        assert tree["task"]["name"] == name
        assert load_config(None, [], base=tree).task == cfg.task
    assert type(RunConfig().task) is T.ReverseTaskConfig  # no name: the default job's task
    assert type(load_config(None, ["--task.seed=3"]).task) is T.ReverseTaskConfig


def test_every_task_type_has_a_builder() -> None:
    """The union and the factory's registry list the same types: a new task type without a
    builder (or a builder of no type) fails here, not in a run."""
    assert set(typing.get_args(TaskConfig)) == set(BUILDERS) == set(TYPES.values())


def test_an_unknown_task_is_refused_listing_the_known_ones(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[task]\nname = "chess"\n')
    for given in ((f, []), (None, ["--task.name=chess"])):
        with pytest.raises(ValueError) as err:
            load_config(*given)
        assert str(err.value).startswith("invalid config key task.name")
        assert "allowed values: 'reverse', 'math', 'agent', 'longtail', 'agentic'" in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["--task.path=x.jsonl"],
         "task.path='x.jsonl' applies to task.name = 'math' | 'agent' only; this run has "
         "task.name='reverse'"),
        (["--task.name=longtail", "--task.reward_fn=m:f"],
         "task.reward_fn='m:f' applies to task.name = 'reverse' | 'math' only; this run has "
         "task.name='longtail'"),
        (["--task.name=math", "--task.num_digits=3"],
         "task.num_digits=3 applies to task.name = 'reverse' | 'longtail' | 'agentic' only"),
        (["--task.longtail.max_len=40"], "applies to task.name = 'longtail' only"),
        (["--task.name=agentic", "--task.agent=m:f"],
         "task.agent='m:f' applies to task.name = 'agent' only; this run has "
         "task.name='agentic'"),
    ],
)  # fmt: skip
def test_a_key_of_another_task_is_refused_naming_its_task(overrides: list[str], said: str) -> None:
    """Not silently ignored (a ``reward_fn`` given to a workload was, before one type per
    task): the message names the task(s) the key belongs to and the run's."""
    with pytest.raises(ValueError) as err:
        load_config(None, overrides)
    assert said in str(err.value)
    with pytest.raises(TypeError):  # in Python too: the type has no such field
        T.ReverseTaskConfig(path="x.jsonl")  # type: ignore[call-arg]


def test_a_task_section_of_an_earlier_version_still_resumes() -> None:
    """Before one type per task, config.json held every task's keys (the defaults of the
    others): those of other tasks are dropped when it is resumed, the task's own are kept."""
    old: dict[str, Any] = {
        "task": {
            "name": "math", "num_digits": 2, "seed": 4, "path": "p.jsonl",
            "prompt_key": "q", "answer_key": "answer", "system_prompt": "", "prompt_format": "auto",
            "max_new_tokens": 0, "shuffle": True, "agent": "", "agent_command": [],
            "reward_fn": "", "longtail": {"min_len": 4, "alpha": 1.0, "max_len": 512},
            "agentic": {"turns": 2, "latency_min_s": 0.02, "alpha": 1.0, "latency_max_s": 0.6},
        }
    }  # fmt: skip
    cfg = load_config(None, [], base=old)
    assert cfg.task == T.MathTaskConfig(seed=4, path="p.jsonl", prompt_key="q")
    switched = load_config(None, ["--task.name=longtail"], base=old)  # an override switches it
    assert switched.task == T.LongTailTaskConfig(seed=4, num_digits=2)


@pytest.mark.parametrize(
    ("overrides", "want"),
    [  # (task.num_digits or None, algo.loss_agg, rollout.extra_args, generation budget)
        ([], (2, "token-mean", (), 3)),
        (["--task.name=longtail"], (1, "seq-mean", ("--context-length", "515"), 512)),
        (["--task.name=longtail", "--task.longtail.max_len=40", "--task.num_digits=2"],
         (2, "seq-mean", ("--context-length", "44"), 40)),
        (["--task.name=longtail", "--model.path=/m"], (1, "seq-mean", (), 512)),
        (["--task.name=longtail", "--rollout.backend=sglang"], (1, "seq-mean", (), 512)),
        (["--task.name=longtail", "--rollout.urls=http://h:1"], (1, "seq-mean", (), 512)),
        (["--task.name=longtail", "--algo.loss_agg=token-mean"],
         (1, "token-mean", ("--context-length", "515"), 512)),
        (["--task.name=agentic"], (1, "token-mean", (), 2)),
        (["--task.name=agentic", "--task.num_digits=3"], (3, "token-mean", (), 4)),
        (["--task.name=math"], (None, "token-mean", (), 16)),
        (["--task.name=math", "--model.path=/m"], (None, "token-mean", (), 512)),
        (["--task.name=math", "--task.max_new_tokens=64"], (None, "token-mean", (), 64)),
        (["--task.name=agent"], (None, "token-mean", (), 128)),
        (["--task.name=agent", "--task.max_new_tokens=20"], (None, "token-mean", (), 20)),
        (["--task.name=agent", "--rollout.max_new_tokens=7"], (None, "token-mean", (), 7)),
        (["--task.name=longtail", "--rollout.max_new_tokens=7"],
         (1, "seq-mean", ("--context-length", "515"), 7)),
    ],
)  # fmt: skip
def test_defaults_a_task_decides_are_as_before(overrides: list[str], want: tuple) -> None:
    """The defaults each task sets (its own ``num_digits``; ``longtail``'s ``algo.loss_agg``
    and, on the tiny model's embedded engine, ``--context-length``) and its generation budget,
    as ``workload_defaults`` and ``RunConfig.generation_budget`` gave them before; a key the
    user sets wins."""
    cfg = load_config(None, overrides)
    digits = getattr(cfg.task, "num_digits", None)
    assert (digits, cfg.algo.loss_agg, cfg.rollout.extra_args, cfg.generation_budget()) == want


def test_what_the_task_decides_for_the_rest_of_the_run() -> None:
    """Only an agent task runs on the tiny chat model and serves the gateway (config.json
    records ``gateway.enabled``); only the single-turn tasks have an eval split."""
    for name, cls in TYPES.items():
        task = load_config(None, [f"--task.name={name}"]).task
        assert task.chat_model == task.serves_gateway == (cls is T.AgentTaskConfig), name
        assert task.single_turn == (name in ("reverse", "math")), name
        recorded = to_dict(RunConfig(task=task))["gateway"]["enabled"]
        assert recorded == (name == "agent")
    assert T.ReverseTaskConfig(seed=1).held_out(100, "") == T.ReverseTaskConfig(seed=101)
    math = T.MathTaskConfig(path="train.jsonl").held_out(100, "eval.jsonl")
    assert math == T.MathTaskConfig(seed=100, path="eval.jsonl", shuffle=False)
    with pytest.raises(ValueError, match=r"eval\.path"):
        T.ReverseTaskConfig().held_out(100, "eval.jsonl")
    with pytest.raises(ValueError, match=r"needs eval\.path"):
        T.MathTaskConfig(path="train.jsonl").held_out(100, "")
    for cls in (T.AgentTaskConfig, T.LongTailTaskConfig, T.AgenticTaskConfig):
        with pytest.raises(ValueError, match=r"eval\.every_steps=0"):
            cls().held_out(100, "")


def test_the_factory_builds_each_kind_of_episode(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Single-turn tasks run ``single_turn`` on the task's reward (the user's ``reward_fn``
    when named), workloads their own episode, agents the gateway's; each with the sampling
    defaults and checkpoint sample type the run used before."""
    from asyncrl.gateway import Gateway
    from asyncrl.tasks.base import CustomReward
    from asyncrl.tasks.reverse import ReverseTask
    from asyncrl.tasks.tiny_chat_model import ensure_tiny_chat_model
    from asyncrl.tasks.workloads import Agentic, LongTail

    model = str(tiny_model_dir)
    built = build_task(RunConfig(), model)
    assert isinstance(built.task, ReverseTask) and built.gateway is None
    assert built.episode.__qualname__.startswith("single_turn.")
    assert built.sampling == {"max_new_tokens": 3} and built.sample_type is Sample
    assert isinstance(next(built.samples), Sample)

    (tmp_path / "my_reward.py").write_text("def score(sample, response_ids):\n    return 0.5\n")
    custom = T.ReverseTaskConfig(reward_fn=f"{tmp_path / 'my_reward.py'}:score")
    built = build_task(RunConfig(task=custom), model)
    assert isinstance(built.task, CustomReward) and built.task.form == "ids"
    assert built.episode.__qualname__.startswith("single_turn.")

    for cfg, kind in (
        (load_config(None, ["--task.name=longtail", "--task.longtail.max_len=40"]), LongTail),
        (load_config(None, ["--task.name=agentic"]), Agentic),
    ):
        built = build_task(cfg, model)
        assert isinstance(built.task, kind) and built.episode == built.task.episode
        assert built.sampling == {"max_new_tokens": cfg.generation_budget()}
        assert built.gateway is None and built.sample_type is Sample

    agent = T.AgentTaskConfig(agent="examples.agents:weather_agent", max_new_tokens=20)
    built = build_task(RunConfig(task=agent), str(ensure_tiny_chat_model()))
    assert isinstance(built.gateway, Gateway) and built.task is built.gateway
    assert built.episode == built.gateway.episode and built.gateway.max_tokens == 20
    assert built.sampling == {} and built.sample_type is Any
    first = next(built.samples)
    assert first.prompt.startswith("What is the weather in ") and first.answer in first.prompt


def test_a_bad_task_fails_when_built_naming_its_key(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"task\.reward_fn 'nosuchmod:f': cannot import"):
        build_task(
            RunConfig(task=T.ReverseTaskConfig(reward_fn="nosuchmod:f")), str(tiny_model_dir)
        )
    with pytest.raises(ValueError, match=r"needs task\.path"):
        build_task(RunConfig(task=T.MathTaskConfig()), str(tiny_model_dir))


def test_the_example_agents_are_out_of_the_product_and_offer_the_trained_tool() -> None:
    """Demo agents live in examples/agents.py (loaded by file or as ``examples.agents``), not
    in asyncrl; the weather agent offers the tool the tiny chat model was trained to call."""
    import asyncrl.gateway.agent as product
    from asyncrl.tasks.base import load_reward_fn
    from asyncrl.tasks.tiny_chat_model import WEATHER_TOOL
    from examples import agents

    for name in ("weather_agent", "reverse_agent", "reverse_chat_agent"):
        assert not hasattr(product, name)
        by_file = load_reward_fn(f"{ROOT / 'examples' / 'agents.py'}:{name}", key="task.agent")
        assert by_file.__name__ == name
    assert agents.WEATHER_TOOL == WEATHER_TOOL
