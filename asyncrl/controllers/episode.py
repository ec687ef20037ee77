"""The agent-loop API: an episode is ``async def episode(ctx, sample) -> Trajectory | ... | None``.

An episode calls ``await ctx.generate(ids)`` any number of times (multi-turn,
tools), appends environment tokens with ``ctx`` helpers, computes a reward and
returns a :class:`Trajectory` (or a list of them, or None to reject the sample).
``ctx.generate`` hides engine interruptions: when a weight update aborts a
request, it re-submits prompt + tokens so far to the same engine with the
remaining ``max_new_tokens`` budget, and records the version of every token.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from asyncrl.engines.rollout.base import EngineError, EngineUnavailable
from asyncrl.transports.experience.types import Trajectory

if TYPE_CHECKING:
    from asyncrl.controllers.router import Router

__all__ = ["Episode", "EpisodeContext", "EpisodeFailed", "Generation", "Sample", "single_turn"]

log = logging.getLogger(__name__)


class Sample(msgspec.Struct, frozen=True):
    """A prompt of a built-in task: token ids plus whatever the reward needs."""

    prompt_ids: list[int]
    answer: Any = None
    id: int = 0


class Generation(msgspec.Struct, gc=False):
    """One completion, possibly stitched from several engine calls across weight updates."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str


class EpisodeFailed(RuntimeError):
    """An episode's generation failed after every retry; its group is reported failed."""


EpisodeResult = Trajectory | list[Trajectory] | None
Episode = Callable[["EpisodeContext", Any], Awaitable[EpisodeResult]]
RewardFn = Callable[[Any, list[int]], "float | Awaitable[float]"]


class EpisodeContext:
    """Handed to each episode: generation with exact versions, ids, and trajectory helpers."""

    def __init__(
        self,
        router: Router,
        group_id: int,
        episode_id: int,
        sampling: dict[str, Any],
        max_retries: int,
        closing: asyncio.Event,
    ):
        self._router = router
        self.group_id = group_id
        self.episode_id = episode_id
        self.sampling = dict(sampling)
        self._max_retries = max_retries
        self._closing = closing
        self._engine: Any = None  # sticky: every turn of an episode goes to one engine

    async def generate(self, input_ids: Sequence[int], **sampling: Any) -> Generation:
        """Complete ``input_ids``; keyword args override the run's sampling params."""
        params = {**self.sampling, **sampling}
        budget = int(params.get("max_new_tokens", 128))
        prefix = list(input_ids)
        out = Generation([], [], [], "length")
        attempts = 0
        while len(out.output_ids) < budget:
            params["max_new_tokens"] = budget - len(out.output_ids)
            rid = f"{self.episode_id}-{len(out.output_ids)}-{attempts}"
            try:
                if self._engine is None:
                    self._engine = self._router.pick()
                res = await self._router.call(self._engine, prefix + out.output_ids, params, rid)
            except (EngineError, EngineUnavailable) as exc:
                attempts += 1
                self._router.report_failure(self._engine, exc)
                self._engine = None
                if attempts > self._max_retries:
                    raise EpisodeFailed(f"episode {self.episode_id}: {exc}") from exc
                await asyncio.sleep(min(2.0, 0.05 * 2**attempts))
                continue
            out.output_ids += res.output_ids
            out.logprobs += res.logprobs
            out.versions += [res.weight_version] * len(res.output_ids)
            out.finish_reason = res.finish_reason
            if res.finish_reason != "abort" or self._closing.is_set():
                break
        return out

    def trajectory(
        self,
        prompt_ids: Sequence[int],
        turns: Sequence[Generation | Sequence[int]],
        reward: float,
        **extra: Any,
    ) -> Trajectory:
        """Build a Trajectory from alternating generations and environment tokens.

        Generated tokens are trained on; environment tokens (plain int sequences)
        are masked out, with log-prob 0 and the version of the turn before them.
        """
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        mask: list[int] = []
        last_version = 0
        for turn in turns:
            if isinstance(turn, Generation):
                ids += turn.output_ids
                lps += turn.logprobs
                vers += turn.versions
                mask += [1] * len(turn.output_ids)
                if turn.versions:
                    last_version = turn.versions[-1]
            else:
                env = list(turn)
                ids += env
                lps += [0.0] * len(env)
                vers += [last_version] * len(env)
                mask += [0] * len(env)
        return Trajectory(
            prompt_ids=np.asarray(prompt_ids, np.int32),
            response_ids=np.asarray(ids, np.int32),
            behav_logprobs=np.asarray(lps, np.float32),
            versions=np.asarray(vers, np.int32),
            loss_mask=np.asarray(mask, np.uint8),
            reward=float(reward),
            group_id=self.group_id,
            episode_id=self.episode_id,
            **extra,
        )


async def call_reward(fn: RewardFn, sample: Any, response_ids: list[int]) -> float:
    """Run a reward function: async ones awaited, sync ones off the event loop."""
    if inspect.iscoroutinefunction(fn):
        return float(await fn(sample, response_ids))
    return float(await asyncio.to_thread(fn, sample, response_ids))


def single_turn(reward_fn: RewardFn) -> Episode:
    """The default episode: one generation from the sample's prompt, scored by ``reward_fn``."""

    async def episode(ctx: EpisodeContext, sample: Sample) -> Trajectory:
        gen = await ctx.generate(sample.prompt_ids)
        reward = await call_reward(reward_fn, sample, gen.output_ids)
        return ctx.trajectory(sample.prompt_ids, [gen], reward)

    return episode
