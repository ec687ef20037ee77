"""Several reward functions with weights (``task.rewards``): a task whose reward is their
weighted sum, each function's value kept on the trajectory (``Trajectory.rewards[name]``).

The episode (:meth:`WeightedRewards.episode`) calls every function on the response, as
``ctx.reward`` does (async ones awaited, sync ones inline when cheap, else in a thread), and
builds the trajectory with ``reward`` = the weighted sum and ``rewards`` = each function's
value by name. ``task.reward_aggregation = "normalize_then_sum"`` is applied later, by the
trainer, over each group (``asyncrl.algorithms.advantages.normalize_then_sum_advantages``):
it needs the group's trajectories, which an episode does not see.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

from asyncrl.config.task import RewardSpec
from asyncrl.controllers.episode import Episode, EpisodeContext, RewardRunner
from asyncrl.core import Sample, Trajectory

__all__ = ["TASK_REWARD", "WeightedRewards"]

TASK_REWARD = "task"
"""``task.rewards[i].fn`` naming the task's own reward."""


class WeightedRewards:
    """The task ``task`` scored by ``specs`` (``task.rewards``): :meth:`reward` is the
    weighted sum, :meth:`score` also gives each function's value by name."""

    def __init__(self, task: Any, specs: list[RewardSpec], model_path: str):
        from asyncrl.tasks.base import CustomReward, load_reward_fn

        self.task = task
        self.names = [s.label for s in specs]
        self.weights = [s.weight for s in specs]
        self.fns: list[Callable[..., Any]] = []
        for i, spec in enumerate(specs):
            key = f"task.rewards[{i}].fn"
            if spec.fn == TASK_REWARD:
                self.fns.append(task.reward)
                continue
            fn = load_reward_fn(spec.fn, key)
            try:
                self.fns.append(CustomReward(task, fn, model_path).reward)
            except TypeError as exc:  # a signature no form fits: the config names it
                raise ValueError(f"{key} {spec.fn!r}: {exc}") from None
        self._runners: list[RewardRunner] | None = None

    def samples(self) -> Iterator[Sample]:
        return self.task.samples()

    def runners(self, inline_s: float = 0.0) -> list[RewardRunner]:
        """One :class:`RewardRunner` per function (made once: they learn which are cheap)."""
        if self._runners is None:
            self._runners = [RewardRunner(fn, inline_s) for fn in self.fns]
        return self._runners

    async def score(self, sample: Any, response_ids: list[int]) -> tuple[float, dict[str, float]]:
        """(the weighted sum, each function's value by name) of ``response_ids``; a function
        that raises or returns no number stops the run (``RewardError`` naming it)."""
        values = await asyncio.gather(*(r(sample, response_ids) for r in self.runners()))
        parts = dict(zip(self.names, values, strict=True))
        return sum(w * v for w, v in zip(self.weights, values, strict=True)), parts

    async def reward(self, sample: Any, response_ids: list[int]) -> float:
        """The weighted sum of the functions' values (the one reward signature)."""
        return (await self.score(sample, response_ids))[0]

    async def __call__(self, sample: Any, response_ids: list[int]) -> float:
        """The object is itself a reward function (:meth:`reward`), whose :meth:`score` an
        eval asks for each function's value (``eval/reward/<name>_mean``)."""
        return await self.reward(sample, response_ids)

    def episode(self, inline_s: float = 0.0002) -> Episode:
        """The single-turn episode: one generation, scored by every function."""
        self.runners(inline_s)

        async def episode(ctx: EpisodeContext, sample: Sample) -> Trajectory:
            gen = await ctx.generate(sample.prompt_ids)
            total, parts = await self.score(sample, gen.output_ids)
            return ctx.trajectory(sample.prompt_ids, [gen], total, rewards=parts)

        return episode
