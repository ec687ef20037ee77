"""The Task seam: a stream of prompts and a reward in [0, 1] for a response."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from asyncrl.config import TaskConfig
from asyncrl.controllers.episode import Sample

__all__ = ["Task", "make_task"]


class Task(Protocol):
    """``samples()`` yields prompts forever; ``reward`` scores response token ids in [0, 1]."""

    max_new_tokens: int

    def samples(self) -> Iterator[Sample]: ...

    def reward(self, sample: Sample, response_ids: list[int]) -> float: ...


def make_task(cfg: TaskConfig, model_path: str) -> Task:
    """The one factory of tasks: chooses the implementation from ``cfg.name``."""
    if cfg.name == "reverse":
        from asyncrl.tasks.reverse import ReverseTask

        return ReverseTask.from_tokenizer_dir(model_path, cfg.num_digits, cfg.seed)
    raise ValueError(f"unknown task.name {cfg.name!r} (allowed: 'reverse')")
