"""Groups between their episodes and a batch: what a group's episodes returned, which ready
groups make the next batch, and dynamic sampling's look-ahead (no I/O, no awaits).

Contract: :func:`collect` turns the results of one group's episodes into its trajectories
and the oldest version of their trained tokens (or says why the group did not finish);
:func:`choose` picks the next batch from the ready groups under the staleness rule, or
none while a straggler must train at this step; :func:`look_ahead` sizes the extra
admissions that replace filtered groups. The controller owns the state and the counters;
these functions only decide.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

import msgspec

from asyncrl.controllers.calls import EpisodeFailed
from asyncrl.controllers.episode import EpisodeContext, EpisodeRejected
from asyncrl.controllers.state import (
    EpisodeState,
    GroupState,
    ReadyState,
    decode_sample,
    encode_sample,
    journal_of,
    traj_from_state,
    traj_state,
)
from asyncrl.core import Trajectory

__all__ = ["Group", "Outcome", "Running", "choose", "collect", "look_ahead", "uniform"]


class Running(msgspec.Struct, gc=False):
    """A running group: its task, its sample, the version at its admission, its episodes."""

    task: asyncio.Task
    sample: Any
    admitted_at: int
    ctxs: list[EpisodeContext]

    def state(self, gid: int) -> GroupState:
        """Its checkpointed form: every episode's journal, the call in progress included."""
        eps = [
            EpisodeState(c.episode_id, journal_of(c.journal, c.current), c.next_rid)
            for c in self.ctxs
        ]
        return GroupState(gid, encode_sample(self.sample), self.admitted_at, eps)


class Group(msgspec.Struct, gc=False):
    """A finished group, ready to train: its trajectories and the oldest version of their
    trained tokens; ``admitted_at``: the version at its admission."""

    gid: int
    sample: Any
    trajs: list[Trajectory]
    min_version: int
    admitted_at: int

    def state(self) -> ReadyState:
        """Its checkpointed form."""
        trajs = [traj_state(t) for t in self.trajs]
        return ReadyState(self.gid, encode_sample(self.sample), trajs, self.min_version,
                          self.admitted_at)  # fmt: skip

    @classmethod
    def of_state(cls, g: ReadyState, sample_type: Any) -> Group:
        """The group a checkpoint holds (``sample_type`` decodes its sample)."""
        sample = decode_sample(g.sample, sample_type)
        trajs = [traj_from_state(t) for t in g.trajs]
        return cls(g.gid, sample, trajs, g.min_version, g.admitted_at)


class Outcome(msgspec.Struct, gc=False):
    """What a group's episodes made: ``trajs`` with ``min_version`` (None: no trajectory,
    the group is rejected; ``cause``: the last :class:`EpisodeRejected`'s message), or
    ``failed``: the first episode that failed fails the group."""

    trajs: list[Trajectory]
    min_version: int | None = None
    cause: str = ""
    failed: EpisodeFailed | None = None


def collect(gid: int, results: Sequence[Any], ctxs: Sequence[EpisodeContext]) -> Outcome:
    """The outcome of group ``gid`` from its episodes' ``results`` (a return value or an
    exception each, in the order of ``ctxs``). Raises an episode's unexpected exception,
    and TypeError for a return value that is no Trajectory, list of them or None."""
    out = Outcome([])
    for r, ctx in zip(results, ctxs):  # noqa: B905 - equal lengths by construction
        if isinstance(r, EpisodeFailed):
            return Outcome([], failed=r)
        if isinstance(r, EpisodeRejected):
            out.cause = str(r)
            continue
        if isinstance(r, BaseException):
            raise r
        if r is None:
            continue
        got = [r] if isinstance(r, Trajectory) else r
        if not isinstance(got, list) or not all(isinstance(t, Trajectory) for t in got):
            msg = f"an episode must return Trajectory, list[Trajectory] or None, got {r!r}"
            raise TypeError(msg)
        for t in got:
            v = ctx.min_version(t)
            if out.min_version is None or v < out.min_version:
                out.min_version = v
            t.group_id = gid
        out.trajs += got
    return out


def uniform(trajs: list[Trajectory]) -> bool:
    """All rewards of a group equal: no signal for a group-relative baseline (DAPO)."""
    return len({t.reward for t in trajs}) == 1


def choose(
    ready: list[Group],
    size: int,
    due: int,
    running_since: int | None,
    last: bool,
) -> tuple[list[Group], list[Group]] | None:
    """The next batch from ``ready`` (every group in it may train at this step): the
    ``size`` oldest-admitted, and the groups left; None to wait.

    Waits while a running group was admitted at a version ``<= due`` (``step -
    max_staleness``; ``running_since``: the oldest running group's version at admission,
    None with none running): its tokens are at least that new, so this step is its last
    chance to train, and taking other groups now would throw its work away — unless
    enough groups just as old are ready to fill the batch without it. With fewer than
    ``size`` ready, takes what is left only when it is the ``last`` batch possible (the
    input ended and used up) and nothing runs."""
    if running_since is not None and running_since <= due:
        if sum(1 for g in ready if g.admitted_at <= due) < size:
            return None
    if len(ready) < size and not (last and ready and running_since is None):
        return None
    ready.sort(key=lambda g: (g.admitted_at, g.min_version, g.gid))
    return ready[:size], ready[size:]


def look_ahead(
    share: float, filtered: int, trained: int, window: int, cap: int
) -> tuple[float, int]:
    """Dynamic sampling's look-ahead: with a share ``f`` of finished groups dropped (moving
    average over the steps, weight 1/2 to the newest; ``share``: the average before this
    step, which filtered ``filtered`` groups and trained ``trained``), a ``window`` of
    ``(s + 1) B`` useful groups in flight needs ``window f / (1 - f)`` more beside it;
    admitting them now starts the refill with the groups it replaces, not after they
    finished, so the trainer waits for the engines' throughput, not for their latency
    twice. Bounded by ``cap`` (``algo.filter_max_groups``, default 10 B) and by
    ``f <= 0.9``. Returns the new average and the groups to admit ahead."""
    new_share = 0.5 * share + 0.5 * filtered / max(1, filtered + trained)
    f = min(new_share, 0.9)
    return new_share, min(cap, math.ceil(window * f / (1.0 - f)))
