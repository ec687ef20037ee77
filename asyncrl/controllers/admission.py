"""The controller's admission path: admitted samples -> group tasks -> ready groups.

Contract: :class:`Admission` is the part of :class:`~asyncrl.controllers.controller.Controller`
that admits samples while the staleness bound allows (:meth:`Admission._admission_loop`),
runs each admitted sample as a group of ``algo.group_size`` episodes (fresh, or replaying
a checkpoint's journals), and ends every group in exactly one counter: ready (appended to
``_ready`` with the oldest version of its trained tokens), filtered (``algo.filter_groups``),
rejected or failed (:class:`~asyncrl.controllers.outcomes.Streaks` bounds those). Each end
releases the group's staleness slot and wakes the admission loop and ``next_batch``. It
is a mixin: the state it reads and writes is the controller's, declared below and set in
``Controller.__init__``. A group task that raises (an episode's unexpected error, a
return value that is no trajectory, :class:`~asyncrl.controllers.outcomes.GroupsFailing`)
goes to the controller's supervision (``_supervise``): the run stops with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from asyncrl import trace
from asyncrl.controllers.calls import EpisodeFailed, Gate
from asyncrl.controllers.episode import Episode, EpisodeContext, EpisodeRejected
from asyncrl.controllers.groups import Group, Running, collect, uniform
from asyncrl.controllers.outcomes import Streaks
from asyncrl.controllers.router import Router
from asyncrl.controllers.samples import Samples
from asyncrl.controllers.staleness import Staleness
from asyncrl.controllers.state import EpisodeState

__all__ = ["Admission"]


class Admission:
    """Admission and the group tasks, a mixin of the controller (see the module docstring)."""

    # the controller's state this part uses (Controller.__init__ sets every one)
    router: Router
    staleness: Staleness
    counters: dict[str, int]
    resumed: dict[str, int]
    _episode: Episode
    _input: Samples
    _ready: list[Group]
    _running: dict[int, Running]
    _gid: int
    _eid: int
    _group_size: int
    _batch_size: int
    _max_retries: int
    _sampling: dict[str, Any]
    _gate: Gate
    _streaks: Streaks
    _filter: bool
    _filter_cap: int
    _filtered_step: int
    _changed: asyncio.Event
    _ready_changed: asyncio.Event
    _supervise: Callable[[asyncio.Task], None]

    async def _admission_loop(self) -> None:
        staleness = self.staleness
        counters = self.counters
        while True:
            while staleness.can_admit():
                ok, sample = self._input.take()
                if not ok:
                    if self._input.ended:
                        self._ready_changed.set()
                    break
                staleness.admit()
                counters["groups_admitted"] += 1
                gid = self._gid
                self._gid += 1
                self._start_group(gid, sample, staleness.version)
            self._changed.clear()
            if staleness.can_admit():  # waiting for input (or the sample source ended)
                await self._changed.wait()
                continue
            with trace.get().span("admission blocked (staleness)", "controller admission"):
                await self._changed.wait()

    def _start_group(
        self, gid: int, sample: Any, admitted_at: int, replay: list[EpisodeState] | None = None
    ) -> None:
        n = self._group_size
        ctxs = (
            [self._context(gid) for _ in range(n)] if replay is None else self._replay(gid, replay)
        )
        task = asyncio.get_running_loop().create_task(self._run_group(gid, sample, ctxs))
        self._running[gid] = Running(task, sample, admitted_at, ctxs)
        task.add_done_callback(self._group_done)

    def _group_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._supervise(task)

    def _release(self, counter: str) -> None:
        self.counters[counter] += 1
        self.staleness.release()
        self._changed.set()
        self._ready_changed.set()  # next_batch may be waiting for this very group

    async def _run_group(self, gid: int, sample: Any, ctxs: list[EpisodeContext]) -> None:
        try:
            await self._group_body(gid, sample, ctxs)
        finally:
            del self._running[gid]

    async def _group_body(self, gid: int, sample: Any, ctxs: list[EpisodeContext]) -> None:
        n = self._group_size
        if n == 1:
            try:
                results: list[Any] = [await self._episode(ctxs[0], sample)]
            except (EpisodeFailed, EpisodeRejected) as exc:
                results = [exc]
        else:
            coros = [self._episode(ctx, sample) for ctx in ctxs]
            results = await asyncio.gather(*coros, return_exceptions=True)
        self.counters["episodes"] += n
        out = collect(gid, results, ctxs)
        if out.failed is not None:
            self._release("failed")
            self._streaks.failed(gid, out.failed)
            return
        if out.min_version is None:
            self._release("rejected")
            self._streaks.rejected(gid, out.cause)
            return
        self._streaks.reset()
        if self._filter and self._filtered_step < self._filter_cap and uniform(out.trajs):
            self._filtered_step += 1
            self._release("filtered")
            return
        ready = Group(gid, sample, out.trajs, out.min_version, self._running[gid].admitted_at)
        self._ready.append(ready)
        if len(self._ready) >= self._batch_size or self._input.ended:
            self._ready_changed.set()

    def _context(self, gid: int, eid: int | None = None) -> EpisodeContext:
        if eid is None:
            eid = self._eid
            self._eid += 1
        return EpisodeContext(self.router, gid, eid, self._sampling, self._max_retries, self._gate)

    def _replay(self, gid: int, episodes: list[EpisodeState]) -> list[EpisodeContext]:
        if len(episodes) != self._group_size:
            raise ValueError(
                f"checkpointed group {gid} has {len(episodes)} episodes, algo.group_size is "
                f"{self._group_size}: resume with the run's own group size"
            )
        ctxs = []
        for e in episodes:
            ctx = self._context(gid, e.episode_id)
            ctx.replay = list(e.calls)
            ctx.next_rid = e.next_rid
            ctxs.append(ctx)
            self.resumed["episodes"] += 1
            self.resumed["kept_tokens"] += sum(len(c.output_ids) for c in e.calls)
        self.resumed["groups"] += 1
        return ctxs
