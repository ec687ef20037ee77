"""The controller: admission -> episode tasks -> grouping -> batches, under a staleness bound.

Data flow (one asyncio loop — uvloop when the CLI runs it; nothing here imports torch)::

  source / submit() ─▶ queued samples
                          │
              [admission loop]  waits for: a queued sample AND
                          │     admitted - released < (s + v + 1)·B   (Staleness, AReaL's rule)
                          ▼
              group task (one per sample) ─▶ n episodes ─▶ ctx.generate ─▶ Router ─▶ engines
                          │   waits for: its n episodes             ▲ abort → resume same engine
                          │   (None → rejected, EpisodeFailed →     │ error/timeout → other engine,
                          │    failed; both release the slot)       │ bounded back-off
                          ▼                                         │
              ready groups (each with the min version of its trained tokens)
                          │
       next_batch()  waits for: B ready groups AND no running group admitted at a version
                          │     <= t - s (it must train at step t or never); drops or re-queues
                          │     (controller.stale_policy) any group with t - min_version > s
                          ▼
              Batch(step=t) ─▶ trainer / the user's loop ─▶ new weights on the engines
                                                              │
       set_version(v) / weight_update(v) ◀────────────────────┘ (the trainer announces v)
          opens admission further (capacity grows by B per version)

- The admission loop waits on ``_changed`` (set by submit, set_version, a release).
- ``next_batch`` waits on ``_ready_changed`` (set when B groups may be ready, the
  version moves, the input ends, or a supervised task fails).
- The health loop probes engines out of rotation every ``health_interval_s``.
- Every background task is supervised: the first exception is re-raised by the
  next ``next_batch`` / ``set_version`` call; ``close()`` cancels everything.

Checkpoints: ``snapshot()`` (taken right after ``next_batch`` handed out step t - 1)
is the controller's part of a run checkpoint; ``Controller(..., resume=state)``
continues from one: counters, data position, ready groups, and running groups whose
episodes replay their generate journals (kept tokens are not generated again).

Accounting (``stats()``): every admitted group ends in exactly one of trained,
rejected, failed, stale_dropped, stale_regenerated (re-queued as a new group), filtered
(``algo.filter_groups``: all rewards equal), or is still running / ready — ``admitted ==
trained + ready + running + rejected + failed + stale_dropped + stale_regenerated +
filtered`` holds at every await point.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Coroutine, Iterable, Iterator, Sequence
from typing import Any

import msgspec

from asyncrl import secret, trace
from asyncrl.config import DEFAULT_MAX_NEW_TOKENS, RunConfig
from asyncrl.controllers.adapters import AdapterNames
from asyncrl.controllers.episode import (
    EngineKeyRefused,
    Episode,
    EpisodeContext,
    EpisodeFailed,
    EpisodeRejected,
    Gate,
)
from asyncrl.controllers.router import Router
from asyncrl.controllers.staleness import Staleness
from asyncrl.controllers.state import (
    ControllerState,
    EpisodeState,
    GroupState,
    ReadyState,
    check_sample,
    decode_sample,
    encode_sample,
    journal_of,
    traj_from_state,
    traj_state,
)
from asyncrl.core import Batch, Trajectory
from asyncrl.engines.rollout.base import EngineError, EngineUnavailable, RolloutEngine
from asyncrl.transports.weights.pausing import pause_engines, resume_engines

__all__ = ["Controller", "GroupsFailing", "NoMoreSamples"]

log = logging.getLogger(__name__)


class NoMoreSamples(Exception):
    """Raised by ``next_batch()`` once ``end_input()`` was called and every sample has been
    trained, rejected or failed: the input is used up, no batch will come. (Before
    ``end_input()``, ``next_batch()`` waits for samples instead.) The last batch before it
    may hold fewer than ``batch_size`` groups."""


class GroupsFailing(RuntimeError):
    """``controller.max_failed_groups`` groups in a row failed or were rejected, none
    finishing between them: the run cannot train (every request fails the same way, every
    agent raises, every episode returns None). The message names the last cause; the run
    stops with it."""


class Group(msgspec.Struct, gc=False):
    gid: int
    sample: Any
    trajs: list[Trajectory]
    min_version: int
    admitted_at: int


_END = object()

_COUNTERS = (
    "groups_admitted",
    "trained",
    "episodes",
    "rejected",
    "failed",
    "stale_dropped",
    "stale_regenerated",
    "filtered",
)


class Controller:
    """Runs episodes concurrently under the staleness bound and hands out batches.

    ``async with Controller(cfg, episode=fn) as ctl:`` then ``ctl.submit(samples)``,
    ``batch = await ctl.next_batch()`` and ``await ctl.set_version(v)`` whenever the
    engines hold version ``v`` (or ``async with ctl.weight_update(v): ...`` around
    loading them). ``engines`` default to SGLang-protocol clients of
    ``config.rollout.urls``; ``source`` is an optional iterable of samples pulled
    lazily; ``start_version`` resumes a run (the admission counters restart from it).
    ``resume`` continues from a checkpointed :class:`ControllerState` (``source`` must
    be the same stream from its start; ``sample_type`` decodes its samples) at
    ``start_version``, the version of the checkpoint's weights.
    """

    def __init__(
        self,
        config: RunConfig,
        episode: Episode,
        engines: Sequence[RolloutEngine] | None = None,
        source: Iterable[Any] | None = None,
        sampling: dict[str, Any] | None = None,
        start_version: int = 0,
        resume: ControllerState | None = None,
        sample_type: Any = Any,
    ):
        if not callable(episode):
            raise TypeError(f"episode must be an async function (ctx, sample), got {episode!r}")
        cc = config.controller
        self.config = config
        self._episode = episode
        self._own_engines = engines is None
        secret.adopt(config.cluster.secret_file)  # the engines' key, as `asyncrl run` holds it
        if engines is None:
            from asyncrl.engines.rollout.factory import make_engine

            if not config.rollout.urls:
                raise ValueError("rollout.urls is empty: pass engines= or name the engine URLs")
            engines = [make_engine(config.rollout, u) for u in config.rollout.urls]
        self.router = Router(
            engines, batch_identical=cc.batch_requests, outage_timeout_s=cc.outage_timeout_s
        )
        self.staleness = Staleness(cc.max_staleness, cc.batch_size, start_version)
        self.step = start_version
        self._batch_size = cc.batch_size
        self._group_size = config.algo.group_size
        self._max_retries = cc.max_retries
        self._max_failed_groups = cc.max_failed_groups
        self._failed_streak = 0
        self._failure_log = _RateLimitedLog(log, first=5, every_s=10.0)
        self._rejected_streak = 0
        self._reject_log = _RateLimitedLog(log, first=1, every_s=30.0)
        self._regenerate = cc.stale_policy == "regenerate"
        self._filter = config.algo.filter_groups  # DAPO dynamic sampling: _uniform groups
        self._filter_cap = config.algo.filter_max_groups or 10 * cc.batch_size
        self._filtered_step = 0  # groups filtered since the last batch
        self._filter_share = 0.0  # moving share of the groups filtered per step (look-ahead)
        self._sampling = {
            "temperature": config.rollout.temperature,
            "top_p": config.rollout.top_p,
            "max_new_tokens": config.rollout.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
            **(sampling or {}),
        }
        self._source: Iterator[Any] | None = iter(source) if source is not None else None
        self._samples: deque[Any] = deque()
        self._ready: list[Group] = []
        self._groups: dict[int, asyncio.Task] = {}
        self._admitted_at: dict[int, int] = {}  # running group -> version at its admission
        self._tasks: set[asyncio.Task] = set()
        self._gid = 0
        self._eid = 0
        self._changed = asyncio.Event()
        self._ready_changed = asyncio.Event()
        self._gate = Gate(cc.retry_backoff_s, cc.retry_backoff_max_s)
        if config.lora.enabled:  # every request names its adapter version
            self._gate.adapters = AdapterNames(
                config.lora.name, cc.max_staleness + 1, start_version
            )
        self._input_ended = False
        self._closing = False
        self._error: BaseException | None = None
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self._drawn = 0  # samples taken from the source (the data stream's position)
        self._ctxs: dict[int, list[EpisodeContext]] = {}  # running group -> its episodes
        self._group_samples: dict[int, Any] = {}  # running group -> its sample
        self._resumed: list[tuple[int, Any, int, list[EpisodeState]]] = []
        self.resumed = {"groups": 0, "episodes": 0, "kept_tokens": 0}
        if resume is not None:
            self._restore(resume, sample_type)

    # -- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> Controller:
        for gid, sample, admitted_at, episodes in self._resumed:  # before any new admission
            self._start_group(gid, sample, admitted_at, episodes)
        self._resumed = []
        self._spawn(self._admission_loop(), "admission")
        self._spawn(self._health_loop(), "health")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel every task (background loops and running groups); close owned engines."""
        self._closing = True
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
        if task.cancelled() or self._closing:
            return
        exc = task.exception()
        if exc is not None and self._error is None:
            # next_batch raises it (the run's console says it): the file only, with its
            # traceback unless that was logged already (a reward function's, RewardError)
            trace_info = None if getattr(exc, "logged", False) else exc
            log.error("controller task %s failed: %r", task.get_name(), exc,
                      exc_info=trace_info, extra={"console": False})  # fmt: skip
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
        """Queue samples; each becomes a group of ``group_size`` episodes when admitted.

        Every sample must be checkpointable (msgpack-encodable: plain data, msgspec Structs,
        dataclasses; see ``state.CHECKPOINTABLE``): a checkpoint stores the pending ones.
        Raises ``TypeError`` naming the field and its type for one that is not, and then
        queues none of ``samples``. (A ``source``'s samples are checked as they are drawn;
        one that fails stops the controller with the same error.)
        """
        if self._input_ended:
            raise ValueError("submit() after end_input(): the controller takes no more samples")
        batch = list(samples)
        for sample in batch:
            check_sample(sample)
        self._samples.extend(batch)
        self._changed.set()

    def end_input(self) -> None:
        """No more samples will come: ``next_batch`` then hands out a last, smaller batch
        and raises :class:`NoMoreSamples` once every group is done."""
        self._input_ended = True
        self._notify()

    async def set_version(self, version: int) -> None:
        """The engines now serve ``version``: admission may open further."""
        self._raise_if_failed()
        self.staleness.set_version(version)
        if self._gate.adapters is not None:
            self._gate.adapters.newest = version
        tracer = trace.get()
        tracer.set_step(version)
        tracer.instant(f"version {version}", "controller")
        self._notify()

    @contextlib.asynccontextmanager
    async def weight_update(self, version: int, mode: str | None = None) -> AsyncIterator[None]:
        """Quiesce the engines for a weight update, then let them go on — always.

        ``mode`` (default ``rollout.pause_mode``, the run's one pause knob): ``abort`` /
        ``retract`` / ``in_place`` pause the engines (aborted requests are resumed by their
        episodes); ``wait`` pauses no engine: it holds new requests and waits for the
        in-flight ones. On leaving the block the engines continue even if the update
        raised; only a successful update sets ``version``.
        """
        mode = mode or self.config.rollout.pause_mode
        modes = self.config.rollout.pause_modes
        if mode != "wait" and mode not in modes:
            allowed = ", ".join(map(repr, (*modes, "wait")))
            raise ValueError(f"pause mode must be one of {allowed}, got {mode!r}")
        engines = self.router.engines
        try:
            if mode == "wait":
                self._gate.open.clear()
                await self._gate.drained.wait()
            else:  # requests sent meanwhile (resumed ones too) queue on the paused engines
                self._failed(await pause_engines(engines, mode))
            yield
        finally:
            if mode != "wait":
                self._failed(await resume_engines(engines))
            self._gate.open.set()
        await self.set_version(version)

    async def interrupt(self, timeout_s: float) -> bool:
        """Bring every running episode's generated tokens into its journal, for a checkpoint
        taken before a stop: no new request is sent (the gate closes), the engines abort
        theirs (``pause_generation("abort")``: each returns its partial output, which its
        episode journals), then the engines continue, still sent nothing. True when every
        request in flight answered within ``timeout_s`` (else the snapshot misses their
        tokens: they are generated again after the resume). Engine errors are reported to
        the router, never raised; the gate stays closed (the run is stopping).

        The engines continue *before* the wait: a request that passed the gate just before it
        closed may reach its engine only after the abort, and a paused engine would hold it
        until resumed — which a wait with the engines still paused never saw (the stop then
        took the whole ``timeout_s``). Continued, the engine answers it (its tokens journaled
        like the aborted ones'), and nothing newer is sent: the gate is closed."""
        self._gate.open.clear()
        engines = self.router.engines
        self._failed(await pause_engines(engines, "abort"))
        self._failed(await resume_engines(engines))
        try:
            await asyncio.wait_for(self._gate.drained.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def _failed(self, failed: list[tuple[RolloutEngine, BaseException]]) -> None:
        """Engines a pause or resume failed on (``transports/weights/pausing.py``, the one
        place engines are paused): an engine's error or an engine down goes to the router
        (a down engine is not paused: fine); anything else is raised."""
        for engine, exc in failed:
            if not isinstance(exc, EngineError | EngineUnavailable):
                raise exc
            self.router.report_failure(engine, exc)

    async def next_batch(self) -> Batch:
        """Wait for ``batch_size`` groups that may train at the next step, and take them."""
        while True:
            self._raise_if_failed()
            if len(self._ready) >= self._batch_size or self._input_ended:
                batch = self._take_batch()
                if batch is not None:
                    return batch
                if self._exhausted():
                    raise NoMoreSamples(f"all samples done after step {self.step - 1}")
            self._ready_changed.clear()
            with trace.get().span("next_batch waits", "controller waits", {"step": self.step}):
                await self._ready_changed.wait()

    async def evaluate(
        self, samples: Iterable[Any], reward: Any, **options: Any
    ) -> dict[str, float]:
        """One eval of ``samples`` scored by ``reward`` on this controller's engines, beside
        training: never admitted (no staleness slot), never trained. ``options``: ``k``,
        ``temperature``, ``greedy``, ``max_new_tokens``, ``pass_threshold`` (see
        :func:`asyncrl.controllers.evaluation.evaluate`); returns its ``eval/...`` metrics."""
        from asyncrl.controllers.evaluation import evaluate

        options.setdefault("max_new_tokens", self._sampling["max_new_tokens"])
        options.setdefault("sampling", {"top_p": self._sampling["top_p"]})
        options.setdefault("max_retries", self._max_retries)
        return await evaluate(self.router, self._gate, list(samples), reward, **options)

    def stats(self) -> dict[str, int]:
        """Counters and gauges (see the module docstring for the accounting identity).
        ``generated_tokens``: every token the engines returned to this controller since it
        started (trained or not: rejected, failed, stale and aborted-then-resumed requests'
        tokens too; not carried over a resume)."""
        return {
            "version": self.staleness.version,
            "step": self.step,
            "admitted_total": self.staleness.admitted,
            "in_flight": self.staleness.in_flight,
            "capacity": self.staleness.capacity,
            "running": len(self._groups),
            "ready": len(self._ready),
            "queued": len(self._samples),
            "engine_failures": self.router.failures,
            "generated_tokens": self.router.generated_tokens,
            "engines_out": len(self.router.unhealthy | self.router.held),
            **self.counters,
        }

    # -- admission ---------------------------------------------------------------------
    def _next_sample(self) -> tuple[bool, Any]:
        if self._samples:
            return True, self._samples.popleft()
        if self._source is not None:
            try:
                sample = next(self._source)
                self._drawn += 1
                check_sample(sample)
                return True, sample
            except StopIteration:
                self._source = None
        return False, None

    def _exhausted(self) -> bool:
        return (
            self._input_ended
            and not self._samples
            and self._source is None
            and not self._groups
            and not self._ready
        )

    async def _admission_loop(self) -> None:
        staleness = self.staleness
        counters = self.counters
        while True:
            while staleness.can_admit():
                ok, sample = self._next_sample()
                if not ok:
                    if self._input_ended:
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
        self._ctxs[gid] = ctxs
        self._group_samples[gid] = sample
        task = asyncio.get_running_loop().create_task(self._run_group(gid, sample, ctxs))
        self._groups[gid] = task
        self._admitted_at[gid] = admitted_at
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
            del self._groups[gid]
            del self._admitted_at[gid]
            del self._ctxs[gid]
            del self._group_samples[gid]

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
        trajs: list[Trajectory] = []
        min_v: int | None = None
        cause = ""
        for r, ctx in zip(results, ctxs):  # noqa: B905 - equal lengths by construction
            if isinstance(r, EpisodeFailed):
                self._group_failed(gid, r)
                return
            if isinstance(r, EpisodeRejected):
                cause = str(r)
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
                min_v = v if min_v is None or v < min_v else min_v
                t.group_id = gid
            trajs += got
        if min_v is None:
            self._group_rejected(gid, cause)
            return
        self._failed_streak = self._rejected_streak = 0
        if self._filter and self._filtered_step < self._filter_cap and _uniform(trajs):
            self._filtered_step += 1
            self._release("filtered")
            return
        self._ready.append(Group(gid, sample, trajs, min_v, self._admitted_at[gid]))
        if len(self._ready) >= self._batch_size or self._input_ended:
            self._ready_changed.set()

    def _group_rejected(self, gid: int, cause: str) -> None:
        """Count a group every episode of which was rejected (returned None or raised
        :class:`EpisodeRejected`, ``cause``: the last one's message); warn (at a bounded
        rate) while every group is rejected: ``next_batch`` would wait for groups that never
        come; stop as :meth:`_group_failed` once the streak reaches the bound."""
        self._release("rejected")
        self._rejected_streak += 1
        why = cause or "every episode returned None"
        if self._rejected_streak >= self._batch_size:
            self._reject_log.warning(
                "%d groups in a row rejected (%s; the last group %d): "
                "next_batch gets no batch while that goes on",
                self._rejected_streak,
                why,
                gid,
            )
        self._failing(f"group {gid} rejected: {why}", None)

    def _group_failed(self, gid: int, exc: EpisodeFailed) -> None:
        """Count a failed group (logged at a bounded rate); raise :class:`GroupsFailing` (the
        run's error, through this group's supervised task) once the streak reaches the bound."""
        self._failure_log.warning("group %d failed: %s", gid, exc)
        self._release("failed")
        if isinstance(exc, EngineKeyRefused):  # no group can succeed: stop at the first
            raise exc
        self._failing(str(exc), exc)

    def _failing(self, cause: str, exc: BaseException | None) -> None:
        """One more group failed or rejected since the last that became ready: at
        ``controller.max_failed_groups`` in a row, raise :class:`GroupsFailing` naming
        ``cause`` (the last)."""
        self._failed_streak += 1
        if self._max_failed_groups and self._failed_streak >= self._max_failed_groups:
            raise GroupsFailing(
                f"{self._failed_streak} groups in a row failed or were rejected and none "
                f"finished (controller.max_failed_groups); the last: {cause}"
            ) from exc

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

    # -- checkpoints -------------------------------------------------------------------
    def snapshot(self) -> ControllerState:
        """The controller's state now (synchronous: one consistent instant; see state.py)."""
        st = self.staleness
        running = []
        for gid in sorted(self._groups):
            sample = self._group_samples[gid]
            eps = [
                EpisodeState(c.episode_id, journal_of(c.journal, c.current), c.next_rid)
                for c in self._ctxs[gid]
            ]
            running.append(GroupState(gid, encode_sample(sample), self._admitted_at[gid], eps))
        ready = [
            ReadyState(
                g.gid,
                encode_sample(g.sample),
                [traj_state(t) for t in g.trajs],
                g.min_version,
                g.admitted_at,
            )
            for g in self._ready
        ]
        return ControllerState(
            step=self.step,
            version=st.version,
            admitted=st.admitted,
            released=st.released,
            counters=dict(self.counters),
            next_gid=self._gid,
            next_eid=self._eid,
            drawn=self._drawn,
            queued=[encode_sample(x) for x in self._samples],
            ready=ready,
            running=running,
        )

    def _restore(self, state: ControllerState, sample_type: Any) -> None:
        st = self.staleness
        st.admitted, st.released = state.admitted, state.released
        self.step = state.step
        self.counters.update(state.counters)
        self._gid, self._eid = state.next_gid, state.next_eid
        self._samples.extend(decode_sample(r, sample_type) for r in state.queued)
        if self._source is not None:
            for _ in range(state.drawn):  # the same stream, continued where it stopped
                if next(self._source, _END) is _END:
                    self._source = None
                    break
        self._drawn = state.drawn
        for g in state.ready:
            sample = decode_sample(g.sample, sample_type)
            trajs = [traj_from_state(t) for t in g.trajs]
            self._ready.append(Group(g.gid, sample, trajs, g.min_version, g.admitted_at))
        self._resumed = [
            (g.gid, decode_sample(g.sample, sample_type), g.admitted_at, g.episodes)
            for g in state.running
        ]

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.controller.health_interval_s)
            if self.router.unhealthy:
                await self.router.probe()

    # -- batches -----------------------------------------------------------------------
    def _take_batch(self) -> Batch | None:
        """Drop or re-queue groups too stale for this step, then take the B oldest-admitted
        (or, once the input ended and nothing else can come, what is left).

        Waits (returns None) while a running group was admitted at a version <= t - s: its
        tokens are at least that new, so step t is its last chance to train; taking other
        groups now would throw its work away. With FIFO admission this makes stale drops
        rare (only after interruptions or failures), at the cost of waiting for a straggler
        only once it is s steps old."""
        step = self.step
        fits = self.staleness.fits
        keep = [g for g in self._ready if fits(step, g.min_version)]
        if len(keep) != len(self._ready):
            for g in self._ready:
                if fits(step, g.min_version):
                    continue
                if self._regenerate:
                    self._samples.appendleft(g.sample)
                    self._release("stale_regenerated")
                else:
                    self._release("stale_dropped")
        self._ready = keep
        size = self._batch_size
        due = step - self.staleness.max_staleness
        if self._groups and min(self._admitted_at.values()) <= due:
            # a running group must train at this step or never: wait for it, unless enough
            # groups just as old are ready to fill the batch without it
            if sum(1 for g in keep if g.admitted_at <= due) < size:
                return None
        if len(keep) < size:
            last = self._input_ended and not self._samples and self._source is None
            if not (last and keep and not self._groups):
                return None
        keep.sort(key=lambda g: (g.admitted_at, g.min_version, g.gid))
        chosen, self._ready = keep[:size], keep[size:]
        self.step += 1
        self.counters["trained"] += len(chosen)
        filtered, self._filtered_step = self._filtered_step, 0
        if self._filter:
            self._admit_ahead(filtered, len(chosen))
        return Batch(
            step=step,
            groups=[g.trajs for g in chosen],
            samples=[g.sample for g in chosen],
            filtered=filtered,
        )

    def _admit_ahead(self, filtered: int, trained: int) -> None:
        """Dynamic sampling's look-ahead: with a share ``f`` of finished groups dropped (moving
        average over the steps, weight 1/2 to the newest), a window of ``(s + 1) B`` useful
        groups in flight needs ``(s + 1) B f / (1 - f)`` more beside it; admitting them now
        starts the refill with the groups it replaces, not after they finished, so the
        trainer waits for the engines' throughput, not for their latency twice. Bounded by
        ``algo.filter_max_groups`` (its default, 10 B) and by ``f <= 0.9``."""
        share = filtered / max(1, filtered + trained)
        self._filter_share = 0.5 * self._filter_share + 0.5 * share
        f = min(self._filter_share, 0.9)
        window = (self.staleness.max_staleness + 1) * self._batch_size
        self.staleness.ahead = min(self._filter_cap, math.ceil(window * f / (1.0 - f)))
        self._changed.set()


def _uniform(trajs: list[Trajectory]) -> bool:
    """All rewards of a group equal: no signal for a group-relative baseline (DAPO)."""
    return len({t.reward for t in trajs}) == 1


class _RateLimitedLog:
    """A warning logged the first ``first`` times, then at most once every ``every_s`` seconds
    with the count of those left out (a run failing every request logs a few lines, not
    thousands)."""

    def __init__(self, logger: logging.Logger, first: int, every_s: float):
        self._log, self._first, self._every_s = logger, first, every_s
        self._count = self._skipped = 0
        self._last = 0.0

    def warning(self, msg: str, *args: Any) -> None:
        self._count += 1
        now = time.monotonic()
        if self._count > self._first and now - self._last < self._every_s:
            self._skipped += 1
            return
        if self._skipped:
            msg += f" (and {self._skipped} more like it since the last such line)"
            self._skipped = 0
        self._last = now
        self._log.warning(msg, *args)
