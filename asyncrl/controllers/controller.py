"""The controller: admission -> episode tasks -> grouping -> batches, under a staleness bound.

Data flow (one asyncio loop; nothing here imports torch)::

    source / submit() ──▶ samples ──▶ [admission loop] ──▶ group task × n episodes ──▶ engines
                                        │ waits for: a sample AND          │ (Router: least
                                        │ in_flight < (s + v + 1)·B        │  outstanding, retries)
                                        ▼                                  ▼
                              Staleness counters ◀── release ── group done: all n episodes
                                        ▲                                  │ (None -> rejected)
                       set_version(v) ──┘                                  ▼
                       (trainer announces)                   ready groups (min token version)
                                                                           │
                                  next_batch() waits for: B ready groups that fit step t
                                  (t - min_version <= s); stale ones dropped or re-generated
                                                                           ▼
                                                       Batch(step=t) ──▶ trainer / user loop

- Admission loop waits on ``_changed`` (set by submit, set_version, release).
- ``next_batch`` waits on ``_ready_changed`` (set when a group finishes or the
  version moves) and on the first failure of any supervised task.
- Every background task is supervised: its exception is re-raised by the next
  ``next_batch``/``set_version`` call, and ``close()`` cancels everything.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Coroutine, Iterable, Iterator, Sequence
from typing import Any

import msgspec

from asyncrl.config import RunConfig
from asyncrl.controllers.episode import Episode, EpisodeContext, EpisodeFailed
from asyncrl.controllers.router import Router
from asyncrl.controllers.staleness import Staleness
from asyncrl.engines.rollout.base import RolloutEngine
from asyncrl.transports.experience.types import Trajectory

__all__ = ["Batch", "Controller"]

log = logging.getLogger(__name__)


class Group(msgspec.Struct, gc=False):
    gid: int
    sample: Any
    trajs: list[Trajectory]
    min_version: int
    order: int


class Batch(msgspec.Struct, gc=False):
    """One train step's data: ``groups`` of trajectories (a GRPO group never splits)."""

    step: int
    groups: list[list[Trajectory]]

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g]

    @property
    def staleness_max(self) -> int:
        return max(self.step - t.min_version for t in self.trajectories)

    @property
    def reward_mean(self) -> float:
        ts = self.trajectories
        return sum(t.reward for t in ts) / len(ts)


class Controller:
    """Runs episodes concurrently under the staleness bound and hands out batches.

    ``async with Controller(cfg, episode=fn, source=samples) as ctl:`` then
    ``batch = await ctl.next_batch()`` and ``await ctl.set_version(v)`` whenever
    the engines hold version ``v``. ``start_version`` resumes a run at a version
    (the admission counters restart from it).
    """

    def __init__(
        self,
        config: RunConfig,
        episode: Episode,
        engines: Sequence[RolloutEngine] | None = None,
        source: Iterable[Any] | None = None,
        sampling: dict[str, Any] | None = None,
        start_version: int = 0,
    ):
        cc = config.controller
        self.config = config
        self._episode = episode
        self._own_engines = engines is None
        if engines is None:
            from asyncrl.engines.rollout.sglang import SGLangClient

            if not config.rollout.urls:
                raise ValueError("rollout.urls is empty: pass engines= or name the engine URLs")
            timeout = config.rollout.request_timeout_s
            engines = [SGLangClient(u, timeout_s=timeout) for u in config.rollout.urls]
        self.router = Router(engines)
        self.staleness = Staleness(cc.max_staleness, cc.batch_size, start_version)
        self.step = start_version
        self._group_size = config.algo.group_size
        self._sampling = {
            "temperature": config.rollout.temperature,
            "top_p": config.rollout.top_p,
            "max_new_tokens": config.rollout.max_new_tokens or 128,
            **(sampling or {}),
        }
        self._source: Iterator[Any] | None = iter(source) if source is not None else None
        self._samples: deque[Any] = deque()
        self._ready: list[Group] = []
        self._groups: dict[int, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()
        self._gids = itertools.count()
        self._eids = itertools.count()
        self._order = itertools.count()
        self._changed = asyncio.Event()
        self._ready_changed = asyncio.Event()
        self._closing = asyncio.Event()
        self._error: BaseException | None = None
        self.counters = dict.fromkeys(
            ["groups_done", "rejected", "failed", "stale_dropped", "stale_regenerated"], 0
        )

    # -- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> Controller:
        self._spawn(self._admission_loop(), "admission")
        self._spawn(self._health_loop(), "health")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closing.set()
        tasks = [*self._tasks, *self._groups.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._own_engines:
            await asyncio.gather(*(e.close() for e in self.router.engines), return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._supervise)
        return task

    def _supervise(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled() or self._closing.is_set():
            return
        exc = task.exception()
        if exc is not None and self._error is None:
            log.error("controller task %s failed: %r", task.get_name(), exc)
            self._error = exc
            self._ready_changed.set()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"controller task failed: {self._error!r}") from self._error

    def _notify(self) -> None:
        self._changed.set()
        self._ready_changed.set()

    # -- public API --------------------------------------------------------------------
    def submit(self, samples: Iterable[Any]) -> None:
        """Queue samples; each becomes a group of ``group_size`` episodes when admitted."""
        self._samples.extend(samples)
        self._notify()

    async def set_version(self, version: int) -> None:
        """The engines now serve ``version``: admission may open further."""
        self._raise_if_failed()
        self.staleness.set_version(version)
        self._notify()

    async def next_batch(self) -> Batch:
        """Wait for ``batch_size`` groups that may train at the next step, and take them."""
        while True:
            self._raise_if_failed()
            batch = self._take_batch()
            if batch is not None:
                return batch
            self._ready_changed.clear()
            await self._ready_changed.wait()

    def stats(self) -> dict[str, int]:
        return {
            "version": self.staleness.version,
            "step": self.step,
            "admitted": self.staleness.admitted,
            "in_flight": self.staleness.in_flight,
            "running_groups": len(self._groups),
            "ready_groups": len(self._ready),
            "queued_samples": len(self._samples),
            "engine_failures": self.router.failures,
            **self.counters,
        }

    # -- admission ---------------------------------------------------------------------
    def _next_sample(self) -> tuple[bool, Any]:
        if self._samples:
            return True, self._samples.popleft()
        if self._source is not None:
            try:
                return True, next(self._source)
            except StopIteration:
                self._source = None
        return False, None

    async def _admission_loop(self) -> None:
        while True:
            while self.staleness.can_admit():
                ok, sample = self._next_sample()
                if not ok:
                    break
                self.staleness.admit()
                gid = next(self._gids)
                task = asyncio.get_running_loop().create_task(self._run_group(gid, sample))
                self._groups[gid] = task
                task.add_done_callback(self._group_done)
            self._changed.clear()
            await self._changed.wait()

    def _group_done(self, task: asyncio.Task) -> None:
        self._groups = {g: t for g, t in self._groups.items() if t is not task}
        if not task.cancelled() and task.exception() is not None:
            self._supervise(task)

    async def _run_group(self, gid: int, sample: Any) -> None:
        results = await asyncio.gather(
            *(self._run_episode(gid, sample) for _ in range(self._group_size)),
            return_exceptions=True,
        )
        trajs: list[Trajectory] = []
        for r in results:
            if isinstance(r, EpisodeFailed):
                log.warning("group %d: %s", gid, r)
                self.counters["failed"] += 1
                self.staleness.release()
                self._notify()
                return
            if isinstance(r, BaseException):
                raise r
            if r is None:
                continue
            trajs.extend(r if isinstance(r, list) else [r])
        self.counters["groups_done"] += 1
        if not trajs:
            self.counters["rejected"] += 1
            self.staleness.release()
            self._notify()
            return
        for t in trajs:
            t.group_id = gid
        min_v = min(t.min_version for t in trajs)
        self._ready.append(Group(gid, sample, trajs, min_v, next(self._order)))
        self._ready_changed.set()

    async def _run_episode(self, gid: int, sample: Any) -> Trajectory | list[Trajectory] | None:
        eid = next(self._eids)
        ctx = EpisodeContext(
            self.router, gid, eid, self._sampling, self.config.controller.max_retries, self._closing
        )
        return await self._episode(ctx, sample)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if self.router.unhealthy:
                await self.router.probe()

    # -- batches -----------------------------------------------------------------------
    def _take_batch(self) -> Batch | None:
        step = self.step
        keep: list[Group] = []
        for g in self._ready:
            if self.staleness.fits(step, g.min_version):
                keep.append(g)
                continue
            self.staleness.release()
            if self.config.controller.stale_policy == "regenerate":
                self.counters["stale_regenerated"] += 1
                self._samples.appendleft(g.sample)
            else:
                self.counters["stale_dropped"] += 1
            self._changed.set()
        self._ready = keep
        size = self.config.controller.batch_size
        if len(keep) < size:
            return None
        keep.sort(key=lambda g: (g.min_version, g.order))
        chosen, self._ready = keep[:size], keep[size:]
        self.step += 1
        return Batch(step=step, groups=[g.trajs for g in chosen])
