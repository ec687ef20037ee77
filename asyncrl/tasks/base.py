"""The Task seam: a stream of prompts and a reward in [0, 1] for a response."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import msgspec

from asyncrl.config import TaskConfig

__all__ = ["CustomReward", "Sample", "Task", "load_reward_fn", "make_task"]


class Sample(msgspec.Struct, frozen=True):
    """A prompt of a task: token ids plus whatever the reward needs (the episode function's
    input; the controller hands each one to an episode).

    ``answer`` must be checkpointable, since a run checkpoint stores every pending sample as
    msgpack: plain data (dict, list, tuple, str, int, float, bool, None, bytes) or msgspec
    Structs / dataclasses of it. The controller refuses a sample that is not when it is
    submitted or drawn (``TypeError`` naming the field and its type), not at the first
    checkpoint. Tuples come back from a checkpoint as lists, Structs and dataclasses as
    dicts unless the resuming controller is given their type (``sample_type``).
    """

    prompt_ids: list[int]
    answer: Any = None
    id: int = 0


class Task(Protocol):
    """``samples()`` yields prompts forever; ``reward`` scores response token ids in [0, 1].

    ``reward`` may be ``async def``; a sync one runs off the event loop. The generation
    budget of a built-in task's episodes is ``RunConfig.generation_budget()``.
    """

    def samples(self) -> Iterator[Sample]: ...

    def reward(self, sample: Sample, response_ids: list[int]) -> float: ...


def make_task(cfg: TaskConfig, model_path: str) -> Task:
    """The one factory of tasks: chooses the implementation from ``cfg.name``, then wraps it
    with ``cfg.reward_fn`` when one is named."""
    task: Any
    if cfg.name == "reverse":
        from asyncrl.tasks.reverse import ReverseTask

        task = ReverseTask.from_tokenizer_dir(model_path, cfg.num_digits, cfg.seed)
    elif cfg.name == "math":
        from asyncrl.tasks.math import MathTask

        task = MathTask(cfg, model_path)
    else:
        raise ValueError(f"unknown task.name {cfg.name!r} (allowed: 'reverse', 'math')")
    if cfg.reward_fn:
        task = CustomReward(task, load_reward_fn(cfg.reward_fn), model_path)
    return task


def load_reward_fn(spec: str) -> Callable[..., Any]:
    """Import ``package.module:function`` (``module.function`` also accepted) — from
    ``sys.path`` or, failing that, from the working directory, as ``python -m`` would — or
    ``path/to/file.py:function`` (loaded from that file)."""
    mod_name, sep, fn_name = spec.partition(":")
    if not sep:
        mod_name, _, fn_name = spec.rpartition(".")
    if not mod_name or not fn_name:
        raise ValueError(f"task.reward_fn {spec!r} must look like 'package.module:function'")
    try:
        module = _import_reward_module(mod_name)
    except (ImportError, OSError) as exc:
        raise ValueError(f"task.reward_fn {spec!r}: cannot import {mod_name!r}: {exc}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"task.reward_fn {spec!r}: {mod_name} has no function {fn_name!r}")
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


class CustomReward:
    """A task whose reward is the user's ``fn(sample, response_ids, response_text)``."""

    def __init__(self, task: Any, fn: Callable[..., Any], model_path: str):
        self.task = task
        self.fn = fn
        decode = getattr(task, "decode", None)
        if decode is None:
            from asyncrl.tasks.text import ChatTokenizer

            decode = ChatTokenizer(model_path).decode
        self.decode = decode
        self.reward = self._async_reward if inspect.iscoroutinefunction(fn) else self._sync_reward

    def samples(self) -> Iterator[Sample]:
        return self.task.samples()

    def _sync_reward(self, sample: Sample, response_ids: list[int]) -> float:
        return float(self.fn(sample, list(response_ids), self.decode(list(response_ids))))

    async def _async_reward(self, sample: Sample, response_ids: list[int]) -> float:
        return float(await self.fn(sample, list(response_ids), self.decode(list(response_ids))))
