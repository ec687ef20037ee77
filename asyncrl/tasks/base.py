"""The Task seam: a stream of prompts and a reward in [0, 1] for a response."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from asyncrl.config import MathTaskConfig, ReverseTaskConfig, TaskConfig
from asyncrl.controllers.rewards import REWARD_SIGNATURE, reward_form, reward_name
from asyncrl.core import Sample

__all__ = [
    "REWARD_SIGNATURE",
    "CustomReward",
    "Task",
    "load_reward_fn",
    "make_task",
    "reward_form",
]

log = logging.getLogger(__name__)


class Task(Protocol):
    """``samples()`` yields prompts forever; ``reward`` scores response token ids in [0, 1].

    ``reward`` has the one reward signature (:data:`REWARD_SIGNATURE`) and may be
    ``async def``; a sync one runs off the event loop. The generation
    budget of a built-in task's episodes is ``RunConfig.generation_budget()``.
    """

    def samples(self) -> Iterator[Sample]: ...

    def reward(self, sample: Sample, response_ids: list[int]) -> float: ...


def make_task(cfg: TaskConfig, model_path: str) -> Task:
    """The single-turn task (a prompt stream and a reward) of the config type ``cfg``
    (``reverse``, ``math``), wrapped with ``cfg.reward_fn`` when one is named (with
    ``cfg.rewards``: a :class:`~asyncrl.tasks.rewards.WeightedRewards`); what runs the
    other tasks is :func:`asyncrl.task_factory.build_task`'s."""
    task: Any
    match cfg:
        case ReverseTaskConfig():
            from asyncrl.tasks.reverse import ReverseTask

            task = ReverseTask.from_tokenizer_dir(model_path, cfg.num_digits, cfg.seed)
        case MathTaskConfig():
            from asyncrl.tasks.math import MathTask

            task = MathTask(cfg, model_path)
        case _:
            raise ValueError(
                f"task.name {cfg.name!r} has no single-turn Task (allowed here: 'reverse', "
                "'math'; 'agent' runs through the gateway, 'longtail' and 'agentic' are "
                "episodes of asyncrl.tasks.workloads: asyncrl.task_factory.build_task builds "
                "them)"
            )
    if cfg.rewards:  # several functions with weights: asyncrl.tasks.rewards
        from asyncrl.tasks.rewards import WeightedRewards

        task = WeightedRewards(task, cfg.rewards, model_path)  # its reward is async
        return task
    if cfg.reward_fn:
        fn = load_reward_fn(cfg.reward_fn)
        try:
            task = CustomReward(task, fn, model_path)
        except TypeError as exc:  # a signature no form fits: the config names it
            raise ValueError(f"task.reward_fn {cfg.reward_fn!r}: {exc}") from None
    return task


def load_reward_fn(spec: str, key: str = "task.reward_fn") -> Callable[..., Any]:
    """Import ``package.module:function`` (``module.function`` also accepted) — from
    ``sys.path`` or, failing that, from the working directory, as ``python -m`` would — or
    ``path/to/file.py:function`` (loaded from that file). Errors name ``key``, the config
    key that gave ``spec`` (``task.agent`` loads the same way)."""
    mod_name, sep, fn_name = spec.partition(":")
    if not sep:
        mod_name, _, fn_name = spec.rpartition(".")
    if not mod_name or not fn_name:
        raise ValueError(f"{key} {spec!r} must look like 'package.module:function'")
    try:
        module = _import_reward_module(mod_name)
    except (ImportError, OSError) as exc:
        raise ValueError(f"{key} {spec!r}: cannot import {mod_name!r}: {exc}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{key} {spec!r}: {mod_name} has no function {fn_name!r}")
    return fn


def _import_reward_module(name: str) -> Any:
    if name.endswith(".py"):  # a file path
        path = Path(name).resolve()
        spec = importlib.util.spec_from_file_location(f"asyncrl_reward_{path.stem}", path)
        if spec is None or spec.loader is None or not path.is_file():
            raise ImportError(f"no such file: {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        if exc.name != name.split(".")[0] or cwd in sys.path:
            raise
        sys.path.append(cwd)  # the user's own module beside them, as `python -m` finds it
        return importlib.import_module(name)


def _warn_legacy(fn: Callable[..., Any]) -> None:
    msg = (
        f"reward function {reward_name(fn)} takes (sample, response_ids, response_text), a "
        f"deprecated form (still called so, until asyncrl 0.2): the one reward signature is "
        f"{REWARD_SIGNATURE}, e.g. `def {getattr(fn, '__name__', 'fn')}(sample, response_ids, "
        "*, text)`"
    )
    warnings.warn(msg, DeprecationWarning, stacklevel=3)
    log.warning("%s", msg)


class CustomReward:
    """A task whose reward is the user's ``fn`` (see :func:`reward_form` for how it is
    called; ``text`` is the response decoded with the task's or the model's tokenizer)."""

    def __init__(self, task: Any, fn: Callable[..., Any], model_path: str):
        self.task = task
        self.fn = fn
        self.form = reward_form(fn)
        if self.form == "legacy":
            _warn_legacy(fn)
        decode = getattr(task, "decode", None)
        if decode is None:
            from asyncrl.tasks.text import ChatTokenizer

            decode = ChatTokenizer(model_path).decode
        self.decode = decode
        self.reward = self._async_reward if inspect.iscoroutinefunction(fn) else self._sync_reward

    def samples(self) -> Iterator[Sample]:
        return self.task.samples()

    def _call(self, sample: Sample, response_ids: list[int]) -> Any:
        ids = list(response_ids)
        if self.form == "ids":
            return self.fn(sample, ids)
        if self.form == "text":
            return self.fn(sample, ids, text=self.decode(ids))
        return self.fn(sample, ids, self.decode(ids))

    # The user's value as it is: the caller (RewardRunner) makes it a float, and names the
    # user's function when it is none (a RewardError, not float()'s TypeError from here).
    def _sync_reward(self, sample: Sample, response_ids: list[int]) -> Any:
        return self._call(sample, response_ids)

    async def _async_reward(self, sample: Sample, response_ids: list[int]) -> Any:
        return await self._call(sample, response_ids)
