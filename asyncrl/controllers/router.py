"""Routing of generation requests across engines: least outstanding requests and health.

Contract:

- :meth:`Router.pick` returns the healthy engine with the fewest requests in
  flight (ties go round-robin, so an idle fleet fills evenly). Stickiness (every
  turn of an episode, and a request resumed after an abort, on the engine that
  served it before) is the episode's: :class:`asyncrl.controllers.episode.EpisodeContext`
  keeps its engine and asks the router again only when that engine left rotation.
- :meth:`Router.call` runs one ``generate`` and counts it as outstanding while
  it runs; a success clears the engine's failure streak. :meth:`Router.stream` is
  the same for ``generate_stream`` (never batched).
- :meth:`Router.report_failure`: an :class:`EngineUnavailable` (unreachable,
  timed out) takes the engine out of rotation at once; server errors take it
  out after ``max_consecutive_errors`` in a row (a bad request never does).
- :meth:`Router.probe` (the controller runs it periodically) puts engines that
  answer the liveness probe (:meth:`RolloutEngine.health`) back into rotation.
- :meth:`Router.in_rotation` waits until some engine is in rotation again (every
  engine restarting, re-syncing or not answering: an outage, not a failure of the
  request), at most ``outage_timeout_s``, then raises :class:`EngineUnavailable`.
- Membership changes (an engine restarted elsewhere, a node joining or leaving):
  :meth:`Router.add` (held out of rotation when ``held``), :meth:`Router.remove`,
  :meth:`Router.hold` (out of rotation until :meth:`Router.admit`, whatever
  the liveness probe says: an engine waiting for the current weights) and
  :meth:`Router.admit`.
- With ``batch_identical``, calls to one engine with equal ``input_ids`` made in
  the same event-loop turn (a GRPO group's ``n`` samples of one prompt start
  together) travel as one batched ``/generate`` (SGLang's list form;
  ``generate_batch``): one HTTP round trip instead of ``n``, and the engine
  prefills the prompt once. Each call still gets its own result, or the batch's
  error (which counts once towards the engine's failure streak); each waits for
  the slowest of its batch.

All methods run on the controller's event loop; none blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from asyncrl import trace
from asyncrl.core import GenerateRequest, GenerateResult
from asyncrl.engines.rollout.base import (
    EngineBadRequest,
    EngineError,
    EngineUnavailable,
    RolloutEngine,
)

__all__ = ["Router"]

log = logging.getLogger(__name__)


class Router:
    """Spreads requests over ``engines`` (see the module docstring for the contract)."""

    def __init__(
        self,
        engines: Sequence[RolloutEngine],
        max_consecutive_errors: int = 3,
        batch_identical: bool = False,
        outage_timeout_s: float = 300.0,
    ):
        if not engines:
            raise ValueError("at least one rollout engine is needed")
        if max_consecutive_errors < 1:
            raise ValueError(f"max_consecutive_errors must be >= 1, got {max_consecutive_errors}")
        self.engines = list(engines)
        self.max_consecutive_errors = max_consecutive_errors
        self.outstanding = {id(e): 0 for e in self.engines}
        self.served = {id(e): 0 for e in self.engines}
        self.unhealthy: set[int] = set()
        self.held: set[int] = set()  # out of rotation until admit() (e.g. not yet re-synced)
        self.failures = 0
        self.generated_tokens = 0  # every token an engine returned (aborted partials too)
        self._streak = {id(e): 0 for e in self.engines}
        self._turn = itertools.count()
        self.batch_identical = batch_identical
        self._pending: dict[tuple[int, tuple[int, ...]], list[_Call]] = {}
        self._sends: set[asyncio.Task] = set()
        self._last_failure: dict[int, Exception] = {}
        self.outage_timeout_s = outage_timeout_s
        self._rotation = asyncio.Event()  # set when an engine may have come back

    # -- choosing ----------------------------------------------------------------------
    def healthy(self) -> list[RolloutEngine]:
        if not self.unhealthy and not self.held:  # the common case: every engine
            return self.engines[:]
        return [e for e in self.engines if id(e) not in self.unhealthy and id(e) not in self.held]

    def pick(self) -> RolloutEngine:
        """The engine for the next request; EngineUnavailable if none is in rotation."""
        healthy = self.healthy()
        if not healthy:
            raise EngineUnavailable("no healthy rollout engine")
        start = next(self._turn) % len(healthy)
        rotated = healthy[start:] + healthy[:start]
        return min(rotated, key=lambda e: self.outstanding[id(e)])

    async def in_rotation(self) -> None:
        """Return once some engine is in rotation; EngineUnavailable after
        ``outage_timeout_s`` without one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.outage_timeout_s
        while not self.healthy():
            left = deadline - loop.time()
            if left <= 0:
                raise EngineUnavailable(
                    f"no rollout engine in rotation for {self.outage_timeout_s:.0f}s "
                    f"({len(self.engines)} engine(s): {len(self.held)} held, "
                    f"{len(self.unhealthy)} not answering)"
                )
            self._rotation.clear()
            try:
                await asyncio.wait_for(self._rotation.wait(), left)
            except asyncio.TimeoutError:
                pass

    # -- calling -----------------------------------------------------------------------
    async def call(
        self, engine: RolloutEngine, input_ids: list[int], params: dict[str, Any], rid: str
    ) -> GenerateResult:
        """``engine.generate`` counted as outstanding while it runs (a trace span on a lane of
        the engine's track, when traced)."""
        self.outstanding[id(engine)] += 1
        tracer = trace.get()
        sampled = tracer.sampled()
        lane = tracer.take_lane(f"generate {getattr(engine, 'url', '?')}") if sampled else ""
        t0 = trace.now_us()
        outcome: GenerateResult | str = "cancelled"
        try:
            if self.batch_identical:
                joined = self._join(engine, input_ids, params, rid)
                try:
                    res = await joined.future
                except asyncio.CancelledError:
                    if joined.sent is not None:  # its request went out: one caller fewer
                        joined.sent.abandoned()
                    raise
            else:
                res = await engine.generate(input_ids, params, rid=rid)
            outcome = res
        except Exception:
            outcome = "error"
            raise
        finally:
            if id(engine) in self.outstanding:  # else it was removed meanwhile
                self.outstanding[id(engine)] -= 1
            if sampled:
                _trace_call(tracer, lane, t0, rid, outcome)
        self.generated_tokens += len(res.output_ids)
        if id(engine) in self.served:
            self._streak[id(engine)] = 0
            self._last_failure.pop(id(engine), None)
            self.served[id(engine)] += 1
        return res

    async def stream(
        self, engine: RolloutEngine, input_ids: list[int], params: dict[str, Any], rid: str
    ) -> AsyncIterator[GenerateResult]:
        """``engine.generate_stream`` counted as outstanding while it runs; a stream that
        ends normally clears the engine's failure streak (as :meth:`call`)."""
        self.outstanding[id(engine)] += 1
        got = 0  # the stream's output is cumulative: its last length is what it returned
        try:
            async for res in engine.generate_stream(input_ids, params, rid=rid):
                got = len(res.output_ids)
                yield res
        finally:
            self.generated_tokens += got
            if id(engine) in self.outstanding:
                self.outstanding[id(engine)] -= 1
        if id(engine) in self.served:
            self._streak[id(engine)] = 0
            self._last_failure.pop(id(engine), None)
            self.served[id(engine)] += 1

    def _join(self, engine: Any, input_ids: list[int], params: dict[str, Any], rid: str) -> _Call:
        """Queue the call with the other calls of this turn to ``engine`` with these ids."""
        loop = asyncio.get_running_loop()
        key = (id(engine), tuple(input_ids))
        calls = self._pending.get(key)
        if calls is None:
            calls = self._pending[key] = []
            loop.call_soon(self._flush, key, engine)
        call = _Call(input_ids, dict(params), rid, loop.create_future())
        calls.append(call)
        return call

    def _flush(self, key: tuple[int, tuple[int, ...]], engine: Any) -> None:
        calls = [c for c in self._pending.pop(key) if not c.future.done()]  # not cancelled
        if not calls:
            return
        task = asyncio.ensure_future(_send(engine, calls))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)
        sent = _Sent(task, len(calls))
        for c in calls:
            c.sent = sent

    # -- health ------------------------------------------------------------------------
    def report_failure(self, engine: RolloutEngine | None, exc: Exception) -> None:
        """Account a failed request of ``engine``; may take it out of rotation."""
        self.failures += 1
        if engine is None or id(engine) not in self.outstanding:
            return
        if isinstance(exc, EngineBadRequest):
            return  # the request was wrong, not the engine
        if self._last_failure.get(id(engine)) is exc:
            return  # the same failed batch, reported by another of its calls
        self._last_failure[id(engine)] = exc
        self._streak[id(engine)] += 1
        if isinstance(exc, EngineUnavailable) or (
            isinstance(exc, EngineError) and self._streak[id(engine)] >= self.max_consecutive_errors
        ):
            self._mark_unhealthy(engine, exc)

    def _mark_unhealthy(self, engine: RolloutEngine, exc: Exception) -> None:
        if id(engine) not in self.unhealthy:
            log.warning("engine %s out of rotation: %s", getattr(engine, "url", "?"), exc)
        self.unhealthy.add(id(engine))

    async def probe(self) -> None:
        """Put engines that answer the liveness probe back into rotation (held ones stay out)."""
        for e in list(self.engines):
            if id(e) in self.unhealthy and id(e) not in self.held and await e.health():
                log.info("engine %s back in rotation", getattr(e, "url", "?"))
                self.unhealthy.discard(id(e))
                self._streak[id(e)] = 0
                self._rotation.set()

    # -- membership --------------------------------------------------------------------
    def add(self, engine: RolloutEngine, held: bool = False) -> None:
        """A new engine joins; ``held``: out of rotation until :meth:`admit`."""
        if id(engine) in self.outstanding:
            raise ValueError(f"engine {getattr(engine, 'url', engine)!r} is already routed to")
        self.engines.append(engine)
        self.outstanding[id(engine)] = 0
        self.served[id(engine)] = 0
        self._streak[id(engine)] = 0
        if held:
            self.held.add(id(engine))
        else:
            self._rotation.set()

    def remove(self, engine: RolloutEngine) -> None:
        """``engine`` leaves: no new request goes to it (requests in flight run out)."""
        if id(engine) not in self.outstanding:
            raise ValueError(f"engine {getattr(engine, 'url', engine)!r} is not routed to")
        self.engines = [e for e in self.engines if e is not engine]
        for table in (self.outstanding, self.served, self._streak, self._last_failure):
            table.pop(id(engine), None)
        self.unhealthy.discard(id(engine))
        self.held.discard(id(engine))

    def hold(self, engine: RolloutEngine) -> None:
        """Keep ``engine`` out of rotation until :meth:`admit` (liveness alone won't do)."""
        self.held.add(id(engine))

    def admit(self, engine: RolloutEngine) -> None:
        """Put ``engine`` (back) into rotation."""
        if id(engine) not in self.outstanding:
            raise ValueError(f"engine {getattr(engine, 'url', engine)!r} is not routed to")
        if id(engine) in self.held | self.unhealthy:
            log.info("engine %s in rotation", getattr(engine, "url", "?"))
        self.held.discard(id(engine))
        self.unhealthy.discard(id(engine))
        self._streak[id(engine)] = 0
        self._rotation.set()

    def find(self, url: str) -> RolloutEngine | None:
        """The engine routed to at ``url``, if any."""
        return next((e for e in self.engines if getattr(e, "url", None) == url), None)

    def stats(self) -> dict[str, Any]:
        """Per-engine outstanding/served counts and health, keyed by URL."""
        return {
            getattr(e, "url", str(i)): {
                "outstanding": self.outstanding[id(e)],
                "served": self.served[id(e)],
                "healthy": id(e) not in self.unhealthy,
                "held": id(e) in self.held,
            }
            for i, e in enumerate(self.engines)
        }


def _trace_call(
    tracer: trace.Tracer, lane: str, t0: float, rid: str, outcome: GenerateResult | str
) -> None:
    """One generation request as a span of its lane (an abort also as a mark); frees the lane.
    ``outcome``: the result, or ``"error"`` / ``"cancelled"`` (the caller gave up on it)."""
    reason = outcome.finish_reason if isinstance(outcome, GenerateResult) else outcome
    args: dict[str, Any] = {"rid": rid, "finish": reason}
    if isinstance(outcome, GenerateResult):
        args.update(tokens=len(outcome.output_ids), version=outcome.weight_version)
    name = "generate" if reason in ("stop", "length") else f"generate ({reason})"
    tracer.complete(name, lane, t0, trace.now_us(), args)
    tracer.free_lane(lane)
    if reason == "abort":
        tracer.instant("abort", lane, {"rid": rid})


class _Call:
    __slots__ = ("future", "input_ids", "params", "rid", "sent")

    def __init__(self, input_ids: list[int], params: dict[str, Any], rid: str, future: Any):
        self.input_ids, self.params, self.rid, self.future = input_ids, params, rid, future
        self.sent: _Sent | None = None  # the request it went out in (set when flushed)


class _Sent:
    """One request sent for several callers: dropped (its task cancelled) once every caller
    gave up on it. Callers count themselves out when cancelled (:meth:`Router.call`): no
    callback per answer, and O(1) per caller rather than a scan of all of them."""

    __slots__ = ("left", "task")

    def __init__(self, task: asyncio.Task, callers: int):
        self.task, self.left = task, callers

    def abandoned(self) -> None:
        self.left -= 1
        if not self.left and not self.task.done():
            self.task.cancel()


async def _send(engine: Any, calls: list[_Call]) -> None:
    """One request for ``calls`` (batched when several); results or the error to each."""
    try:
        if len(calls) == 1:
            c = calls[0]
            results = [await engine.generate(c.input_ids, c.params, rid=c.rid)]
        else:
            requests = [GenerateRequest(c.input_ids, c.params, c.rid) for c in calls]
            results = await engine.generate_batch(requests)
    except asyncio.CancelledError:
        for c in calls:
            c.future.cancel()
        raise
    except Exception as exc:  # not handled here: handed to every caller, each deals with it
        for c in calls:
            if not c.future.done():
                c.future.set_exception(exc)
        return
    for c, res in zip(calls, results, strict=True):
        if not c.future.done():
            c.future.set_result(res)
