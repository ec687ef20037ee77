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
from collections.abc import AsyncIterator, Coroutine, Iterable, Sequence
from typing import Any

from asyncrl import secret, trace
from asyncrl.config import DEFAULT_MAX_NEW_TOKENS, RunConfig
from asyncrl.controllers.adapters import AdapterNames
from asyncrl.controllers.admission import Admission
from asyncrl.controllers.calls import Gate
from asyncrl.controllers.episode import Episode
from asyncrl.controllers.groups import Group, Running, choose, look_ahead
from asyncrl.controllers.outcomes import GroupsFailing, Streaks
from asyncrl.controllers.quiesce import Quiescer
from asyncrl.controllers.router import Router
from asyncrl.controllers.samples import Samples
from asyncrl.controllers.staleness import Staleness
from asyncrl.controllers.state import ControllerState, EpisodeState, decode_sample
from asyncrl.core import Batch
from asyncrl.engines.rollout.base import RolloutEngine

__all__ = ["Controller", "GroupsFailing", "NoMoreSamples"]

log = logging.getLogger(__name__)


class NoMoreSamples(Exception):
    """Raised by ``next_batch()`` once ``end_input()`` was called and every sample has been
    trained, rejected or failed: the input is used up, no batch will come. (Before
    ``end_input()``, ``next_batch()`` waits for samples instead.) The last batch before it
    may hold fewer than ``batch_size`` groups."""


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


class Controller(Admission):
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
        self.router = Router(
            _engines_of(config) if engines is None else engines,
            batch_identical=cc.batch_requests,
            outage_timeout_s=cc.outage_timeout_s,
        )
        self.staleness = Staleness(cc.max_staleness, cc.batch_size, start_version)
        self.step = start_version
        self._batch_size = cc.batch_size
        self._group_size = config.algo.group_size
        self._max_retries = cc.max_retries
        self._streaks = Streaks(log, cc.batch_size, cc.max_failed_groups)
        self._regenerate = cc.stale_policy == "regenerate"
        self._filter = config.algo.filter_groups  # DAPO dynamic sampling: uniform groups
        self._filter_cap = config.algo.filter_max_groups or 10 * cc.batch_size
        self._filtered_step = 0  # groups filtered since the last batch
        self._filter_share = 0.0  # moving share of the groups filtered per step (look-ahead)
        self._sampling = _sampling_of(config, sampling)
        self._input = Samples(source)
        self._init_groups()
        self._gate = Gate(cc.retry_backoff_s, cc.retry_backoff_max_s)
        if config.lora.enabled:  # every request names its adapter version
            self._gate.adapters = AdapterNames(
                config.lora.name, cc.max_staleness + 1, start_version
            )
        self._quiesce = Quiescer(self.router, self._gate)
        self._closing = False
        self._error: BaseException | None = None
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.resumed = {"groups": 0, "episodes": 0, "kept_tokens": 0}
        if resume is not None:
            self._restore(resume, sample_type)

    def _init_groups(self) -> None:
        """The queues and the running groups' books, empty; the events that wake the loops."""
        self._ready: list[Group] = []
        self._running: dict[int, Running] = {}
        self._tasks: set[asyncio.Task] = set()
        self._gid = 0
        self._eid = 0
        self._changed = asyncio.Event()
        self._ready_changed = asyncio.Event()
        self._resumed: list[tuple[int, Any, int, list[EpisodeState]]] = []

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
        tasks = [*self._tasks, *(r.task for r in self._running.values())]
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
        self._input.submit(samples)
        self._changed.set()

    def end_input(self) -> None:
        """No more samples will come: ``next_batch`` then hands out a last, smaller batch
        and raises :class:`NoMoreSamples` once every group is done."""
        self._input.end()
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
        async with self._quiesce.paused(mode):
            yield
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
        return await self._quiesce.interrupt(timeout_s)

    async def next_batch(self) -> Batch:
        """Wait for ``batch_size`` groups that may train at the next step, and take them."""
        while True:
            self._raise_if_failed()
            if len(self._ready) >= self._batch_size or self._input.ended:
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
            "running": len(self._running),
            "ready": len(self._ready),
            "queued": len(self._input),
            "engine_failures": self.router.failures,
            "generated_tokens": self.router.generated_tokens,
            "engines_out": len(self.router.unhealthy | self.router.held),
            **self.counters,
        }

    # -- batches -----------------------------------------------------------------------
    def _exhausted(self) -> bool:
        return self._input.used_up and not self._running and not self._ready

    # -- checkpoints -------------------------------------------------------------------
    def snapshot(self) -> ControllerState:
        """The controller's state now (synchronous: one consistent instant; see state.py)."""
        st = self.staleness
        running = [self._running[gid].state(gid) for gid in sorted(self._running)]
        queued, drawn = self._input.state()
        return ControllerState(
            step=self.step,
            version=st.version,
            admitted=st.admitted,
            released=st.released,
            counters=dict(self.counters),
            next_gid=self._gid,
            next_eid=self._eid,
            drawn=drawn,
            queued=queued,
            ready=[g.state() for g in self._ready],
            running=running,
        )

    def _restore(self, state: ControllerState, sample_type: Any) -> None:
        st = self.staleness
        st.admitted, st.released = state.admitted, state.released
        self.step = state.step
        self.counters.update(state.counters)
        self._gid, self._eid = state.next_gid, state.next_eid
        self._input.restore(state.queued, state.drawn, sample_type)
        self._ready += [Group.of_state(g, sample_type) for g in state.ready]
        self._resumed = [
            (g.gid, decode_sample(g.sample, sample_type), g.admitted_at, g.episodes)
            for g in state.running
        ]

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.controller.health_interval_s)
            if self.router.unhealthy:
                await self.router.probe()

    def _take_batch(self) -> Batch | None:
        """Drop or re-queue groups too stale for this step, then take the B oldest-admitted
        (or, once the input ended and nothing else can come, what is left); None while a
        running group must train at this step (:func:`~asyncrl.controllers.groups.choose`).
        With FIFO admission this makes stale drops rare (only after interruptions or
        failures), at the cost of waiting for a straggler only once it is s steps old."""
        step = self.step
        fits = self.staleness.fits
        keep = [g for g in self._ready if fits(step, g.min_version)]
        if len(keep) != len(self._ready):
            for g in self._ready:
                if fits(step, g.min_version):
                    continue
                if self._regenerate:
                    self._input.requeue(g.sample)
                    self._release("stale_regenerated")
                else:
                    self._release("stale_dropped")
        self._ready = keep
        running_since = min((r.admitted_at for r in self._running.values()), default=None)
        due = step - self.staleness.max_staleness
        picked = choose(keep, self._batch_size, due, running_since, self._input.used_up)
        if picked is None:
            return None
        chosen, self._ready = picked
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
        """Dynamic sampling's look-ahead (:func:`~asyncrl.controllers.groups.look_ahead`):
        admit that many groups beyond the staleness window."""
        window = (self.staleness.max_staleness + 1) * self._batch_size
        self._filter_share, self.staleness.ahead = look_ahead(
            self._filter_share, filtered, trained, window, self._filter_cap
        )
        self._changed.set()


def _engines_of(config: RunConfig) -> list[RolloutEngine]:
    """SGLang-protocol clients (or the configured family's) of ``config.rollout.urls``."""
    from asyncrl.engines.rollout.factory import make_engine

    if not config.rollout.urls:
        raise ValueError("rollout.urls is empty: pass engines= or name the engine URLs")
    return [make_engine(config.rollout, u) for u in config.rollout.urls]


def _sampling_of(config: RunConfig, sampling: dict[str, Any] | None) -> dict[str, Any]:
    """The run's sampling parameters (``rollout.*``), ``sampling`` overriding them."""
    return {
        "temperature": config.rollout.temperature,
        "top_p": config.rollout.top_p,
        "max_new_tokens": config.rollout.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
        **(sampling or {}),
    }
