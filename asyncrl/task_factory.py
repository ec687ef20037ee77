"""The one task factory: what a run's episodes are, from its ``task`` config.

:func:`build_task` builds, for the config type ``task.name`` chose (``asyncrl.config.task``),
the task, its episode function, its sample stream and its sampling defaults, and for an agent
task the gateway its episodes run through; :func:`check_task` is the task's part of
``preflight`` (what this host must hold for it). Each task type has one line in
:data:`BUILDERS`; this module (with ``asyncrl.tasks.make_task``, which picks among the
single-turn tasks) is the only place that tells the tasks apart; what a task decides
about the rest of the run (its generation budget, which tiny model, its defaults in other
sections) is the config type's own.

The kinds of episode: a single-turn task (``reverse``, ``math``: a prompt stream and a
reward, ``task.reward_fn`` replacing it) runs :func:`~asyncrl.controllers.episode.single_turn`;
a workload (``longtail``, ``agentic``) its own multi-turn episode; ``agent`` an OpenAI-API
agent per episode through the gateway. This module sits above ``tasks``, ``controllers`` and
``gateway`` (it imports them when it builds) and below the runner.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.config import (
    AgenticTaskConfig,
    AgentTaskConfig,
    LongTailTaskConfig,
    MathTaskConfig,
    ReverseTaskConfig,
    RunConfig,
)
from asyncrl.core import Sample

if TYPE_CHECKING:
    from asyncrl.controllers.episode import Episode, RewardFn
    from asyncrl.gateway.app import Gateway

__all__ = [
    "BUILDERS",
    "BuiltTask",
    "build_task",
    "check_aggregation",
    "check_task",
    "eval_samples",
]


@dataclass(frozen=True)
class BuiltTask:
    """A run's task, built: ``episode`` runs once per episode on a sample of ``samples``
    (restored from a checkpoint as ``sample_type``), with ``sampling`` as the controller's
    sampling defaults; ``gateway`` (agent tasks) is attached to the controller and served."""

    task: Any
    """What was built: a :class:`~asyncrl.tasks.base.Task`, a workload or the gateway."""
    episode: Episode
    samples: Iterable[Any] | None
    """The prompt stream (None: samples come by ``Controller.submit``)."""
    sampling: dict[str, Any] = field(default_factory=dict)
    sample_type: Any = Sample
    gateway: Gateway | None = None


def _single_turn(cfg: RunConfig, model_path: str) -> BuiltTask:
    from asyncrl.controllers.episode import single_turn
    from asyncrl.tasks.base import make_task
    from asyncrl.tasks.rewards import WeightedRewards

    assert isinstance(cfg.task, ReverseTaskConfig | MathTaskConfig)
    check_aggregation(cfg)
    task = make_task(cfg.task, model_path)
    if isinstance(task, WeightedRewards):  # several functions: each kept on the trajectory
        episode = task.episode(cfg.controller.inline_reward_s)
    else:
        episode = single_turn(task.reward, cfg.controller.inline_reward_s)
    budget = {"max_new_tokens": cfg.generation_budget()}
    if isinstance(cfg.task, MathTaskConfig):  # its samples name their source: restored so
        from asyncrl.tasks.data import DataSample

        return BuiltTask(task, episode, task.samples(), budget, sample_type=DataSample)
    return BuiltTask(task, episode, task.samples(), budget)


def check_aggregation(cfg: RunConfig) -> None:
    """ValueError naming the keys where ``task.reward_aggregation = "normalize_then_sum"``
    meets an algorithm it does not define the advantage of: it *is* GRPO's advantage (TRL
    1.16 ``grpo_trainer.py:2790-2799``), so ``algo.name`` must be ``grpo``; and the overlong
    penalty (``algo.overlong_buffer_len``) would have to be one more reward function."""
    t = cfg.task
    if not isinstance(t, ReverseTaskConfig | MathTaskConfig):
        return
    if t.reward_aggregation != "normalize_then_sum":
        return
    if cfg.algo.name != "grpo":
        raise ValueError(
            f"task.reward_aggregation='normalize_then_sum' is GRPO's advantage (TRL's "
            f"multi_objective_aggregation), not algo.name={cfg.algo.name!r}'s: use "
            "algo.name='grpo' or task.reward_aggregation='sum'"
        )
    if cfg.algo.overlong_buffer_len:
        raise ValueError(
            "algo.overlong_buffer_len shapes the summed reward; with "
            "task.reward_aggregation='normalize_then_sum' write the length penalty as one of "
            "task.rewards instead (or set algo.overlong_buffer_len=0)"
        )


def _longtail(cfg: RunConfig, model_path: str) -> BuiltTask:
    from asyncrl.tasks.workloads import LongTail

    assert isinstance(cfg.task, LongTailTaskConfig)
    w = LongTail(model_path, cfg.algo.group_size, cfg.task)
    return BuiltTask(w, w.episode, w.samples(), {"max_new_tokens": cfg.generation_budget()})


def _agentic(cfg: RunConfig, model_path: str) -> BuiltTask:
    from asyncrl.tasks.workloads import Agentic

    assert isinstance(cfg.task, AgenticTaskConfig)
    w = Agentic(model_path, cfg.algo.group_size, cfg.task)
    return BuiltTask(w, w.episode, w.samples(), {"max_new_tokens": cfg.generation_budget()})


def _agent(cfg: RunConfig, model_path: str) -> BuiltTask:
    from asyncrl.gateway.agent import agent_gateway, agent_samples

    gw = agent_gateway(cfg, model_path)  # its budget: a completion naming no max_tokens
    # a checkpoint's queue holds AgentSamples and client-opened groups (SessionSample):
    # restored as dicts, typed again by gateway.episode
    return BuiltTask(gw, gw.episode, agent_samples(cfg), sample_type=Any, gateway=gw)


BUILDERS: dict[type, Callable[[RunConfig, str], BuiltTask]] = {
    ReverseTaskConfig: _single_turn,
    MathTaskConfig: _single_turn,
    AgentTaskConfig: _agent,
    LongTailTaskConfig: _longtail,
    AgenticTaskConfig: _agentic,
}
"""Per task config type, its builder: one line per task."""


def build_task(cfg: RunConfig, model_path: str) -> BuiltTask:
    """The run's task from ``cfg.task`` (and the sections it reads: ``algo.group_size``,
    ``controller.inline_reward_s``, ``gateway``), on the model at ``model_path``. Built before
    any process starts: a bad task (a missing file, a reward function that does not import)
    fails fast with a ValueError naming its key."""
    return BUILDERS[type(cfg.task)](cfg, model_path)


def eval_samples(cfg: RunConfig, model_path: str) -> tuple[list[Any], RewardFn]:
    """The held-out prompts of ``asyncrl run``'s evals (``eval.path`` / ``eval.sources``, else
    the task's eval
    split: :meth:`~asyncrl.config.task.ReverseTaskConfig.held_out`) and the task's reward.
    ValueError for a task without one, naming the keys."""
    from asyncrl.controllers.evaluation import EVAL_SEED_OFFSET
    from asyncrl.tasks.base import make_task

    held_out = cfg.task.held_out(EVAL_SEED_OFFSET, cfg.eval.path, tuple(cfg.eval.sources))
    from asyncrl.tasks.rewards import WeightedRewards

    task = make_task(held_out, model_path)
    # several reward functions: the object itself, whose score() gives each one's value
    reward = task if isinstance(task, WeightedRewards) else task.reward
    return list(itertools.islice(task.samples(), cfg.eval.num_prompts)), reward


def check_task(cfg: RunConfig) -> None:
    """The task's preflight: ValueError (one line, naming the key) when this host cannot run
    it: ``math`` without its files or folders (``task.path``, ``task.sources``), ``agent``
    without one of ``task.agent`` / ``task.agent_command``, with a ``task.path`` that is no
    file, or with an agent function that does not import, is not an ``async def`` or does
    not take ``(client, sample)``; ``task.reward_aggregation`` with an algorithm it does not
    fit (:func:`check_aggregation`)."""
    t = cfg.task
    check_aggregation(cfg)
    if isinstance(t, MathTaskConfig):
        key = "task.sources" if t.sources else "task.path"
        for path in [s.path for s in t.all_sources()] or [""]:
            if not path or not Path(path).exists():
                raise ValueError(f"{key} {path!r} is not a file or folder (task.name='math')")
    if isinstance(t, AgentTaskConfig):
        from asyncrl.gateway.agent import check_agent

        check_agent(t)
