"""The agent-loop API: an episode is ``async def episode(ctx, sample) -> Trajectory | ... | None``.

An episode calls ``await ctx.generate(ids)`` any number of times (multi-turn,
tools), interleaves environment tokens (tool output, user turns) that are masked
out of the loss, computes a reward (``await ctx.reward(fn, sample, ids)`` calls
``fn(sample, ids)``, the one reward signature of asyncrl, also that of
``task.reward_fn``: sync functions run off the event loop unless they are measured
cheap, async ones are awaited) and returns ``ctx.trajectory(...)`` — or a list of trajectories, or
None to reject the sample (its group then never trains; the others of the group train
without it). Raising :class:`EpisodeRejected` rejects it the same way, with a cause the
controller names if rejections go on (``controller.max_failed_groups``).

``ctx.generate_stream`` is ``generate`` yielding the completion as it grows (the OpenAI
gateway streams with it); both hide engine interruptions and failures:

- a request that a weight update aborted (``finish_reason == "abort"``) is
  re-submitted to the *same* engine as prompt + tokens generated so far, with
  the remaining ``max_new_tokens`` budget; every token keeps the version the
  engine reported for the call that produced it;
- an engine error or timeout retries the request on another healthy engine
  after a bounded exponential back-off (``controller.retry_backoff_s`` doubling
  up to ``retry_backoff_max_s``); after ``controller.max_retries`` retries the
  episode raises :class:`EpisodeFailed` and its group is reported failed;
- when no engine is in rotation (each restarting, re-syncing or not answering)
  the request waits for one to come back (``Router.in_rotation``, at most
  ``controller.outage_timeout_s``) and is then retried with its tokens kept: an
  outage is no failure of the episode, so a dead engine loses no sample.

Every context keeps a journal of its ``generate`` calls (the call in progress
included, with the tokens received so far). A run checkpoint stores it; on resume
the episode runs again from its start and each ``generate`` call is answered from
the journal (a finished call at once, the interrupted one continued from its kept
tokens), so nothing that was generated is generated again. This asks of an episode
what any resumable agent loop needs: given the same generations it makes the same
calls. A call whose input differs from the journal's ends the replay (logged); the
episode then generates afresh from there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from asyncrl.controllers.calls import (
    EngineCalls,
    EngineKeyRefused,
    EpisodeFailed,
    Gate,
    Generation,
    input_crc,
)
from asyncrl.controllers.rewards import RewardError, RewardFn, RewardRunner, call_reward
from asyncrl.core import Sample, Trajectory

__all__ = [
    "EngineKeyRefused",
    "Episode",
    "EpisodeContext",
    "EpisodeFailed",
    "EpisodeRejected",
    "Gate",
    "Generation",
    "RewardError",
    "RewardRunner",
    "Sample",
    "call_reward",
    "input_crc",
    "single_turn",
]


class EpisodeRejected(Exception):
    """Raised by an episode instead of returning None: its sample is rejected, not the run.
    The message is the cause (the gateway's agent episodes: the agent's error or timeout,
    with the sample id); the run stops naming the last one once
    ``controller.max_failed_groups`` groups in a row were failed or rejected."""


EpisodeResult = Trajectory | list[Trajectory] | None
Episode = Callable[["EpisodeContext", Any], Awaitable[EpisodeResult]]


class EpisodeContext(EngineCalls):
    """Handed to each episode: generation with exact versions (:class:`EngineCalls`:
    ``generate``, ``generate_stream``, the journal), rewards, trajectory helpers."""

    __slots__ = ()

    async def reward(
        self,
        fn: RewardFn | RewardRunner,
        sample: Any,
        response_ids: list[int],
        text: str | None = None,
    ) -> float:
        """``fn(sample, response_ids)``, the one reward signature (``REWARD_SIGNATURE``; with
        a keyword-only ``text`` parameter, ``fn(sample, response_ids, text=text)``): async
        functions awaited, sync ones off the event loop. A function of another form is
        refused (TypeError showing the signature to write); one that raises stops the run
        (:class:`RewardError`)."""
        runner = fn if isinstance(fn, RewardRunner) else RewardRunner(fn, inline_s=0.0)
        return await runner(sample, response_ids, text)

    def trajectory(
        self,
        prompt_ids: Sequence[int],
        turns: Sequence[Generation | Sequence[int]],
        reward: float,
        **extra: Any,
    ) -> Trajectory:
        """Build a Trajectory from alternating generations and environment tokens.

        Generated tokens are trained on; environment tokens (plain int sequences)
        are masked out, with log-prob 0 and the version of the turn before them
        (of the turn after them when they come first).
        """
        if len(turns) == 1 and isinstance(turns[0], Generation):  # the common single turn
            g = turns[0]
            ids, lps, vers = g.output_ids, g.logprobs, g.versions
            mask = _ones(len(ids))
            oldest = min(vers) if vers else 0
        else:
            ids, lps, vers, mask_list = _stitch(turns)
            mask = np.asarray(mask_list, np.uint8)
            gens = [t.versions[0] for t in turns if isinstance(t, Generation) and t.versions]
            oldest = min(gens) if gens else (min(vers) if vers else 0)
        if extra and (unknown := sorted(set(extra) - set(Trajectory.__struct_fields__))):
            raise TypeError(
                f"episode {self.episode_id}: ctx.trajectory() got unknown field(s) {unknown}; "
                f"a Trajectory has {', '.join(Trajectory.__struct_fields__)}"
            )
        last = next((t for t in reversed(turns) if isinstance(t, Generation)), None)
        if last is not None and last.finish_reason == "length":  # algo.mask_truncated reads it
            extra["metadata"] = {**extra.get("metadata", {}), "truncated": True}
        traj = Trajectory(
            prompt_ids=np.asarray(prompt_ids, np.int32),
            response_ids=np.asarray(ids, np.int32),
            behav_logprobs=np.asarray(lps, np.float32),
            versions=np.asarray(vers, np.int32),
            loss_mask=mask,
            reward=float(reward),
            group_id=self.group_id,
            episode_id=self.episode_id,
            **extra,
        )
        return self._made(traj, oldest)

    def _made(self, traj: Trajectory, oldest: int) -> Trajectory:
        # Versions only grow over time, so the first generated token is the oldest: a lower
        # bound of the trained tokens' version however the episode edits loss_mask later.
        self.made.append((traj, oldest))
        return traj

    def min_version(self, traj: Trajectory) -> int:
        """Oldest version of ``traj``'s trained tokens (cached when this context built it)."""
        for t, oldest in self.made:
            if t is traj:
                return oldest
        return traj.min_version


def _ones(n: int) -> np.ndarray:
    """A loss mask of n ones, the trajectory's own (writable: a trainer wraps it with
    ``torch.from_numpy`` without a copy or a warning, and may edit it)."""
    return np.ones(n, np.uint8)


def _stitch(
    turns: Sequence[Generation | Sequence[int]],
) -> tuple[list[int], list[float], list[int], list[int]]:
    first = next((t.versions[0] for t in turns if isinstance(t, Generation) and t.versions), 0)
    ids: list[int] = []
    lps: list[float] = []
    vers: list[int] = []
    mask: list[int] = []
    last_version = first
    for turn in turns:
        if isinstance(turn, Generation):
            ids += turn.output_ids
            lps += turn.logprobs
            vers += turn.versions
            mask += [1] * len(turn.output_ids)
            if turn.versions:
                last_version = turn.versions[-1]
        else:
            env = [int(t) for t in turn]
            ids += env
            lps += [0.0] * len(env)
            vers += [last_version] * len(env)
            mask += [0] * len(env)
    return ids, lps, vers, mask


def single_turn(reward_fn: RewardFn, inline_reward_s: float = 0.0002) -> Episode:
    """The default episode: one generation from the sample's prompt, scored by ``reward_fn``."""
    runner = RewardRunner(reward_fn, inline_reward_s)

    async def episode(ctx: EpisodeContext, sample: Sample) -> Trajectory:
        gen = await ctx.generate(sample.prompt_ids)
        reward = await runner(sample, gen.output_ids)
        return ctx.trajectory(sample.prompt_ids, [gen], reward)

    return episode
