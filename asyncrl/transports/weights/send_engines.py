"""The engines a weight sender pushes to (trainer process): one object both senders use.

:class:`EngineGroup` holds what every weight transport does the same way: the HTTP
client of each engine, the background thread whose asyncio loop runs every push and
re-form, one at a time (``lock``), the run's engine set (``engines_changed``: the next
push or re-form uses it; one under way stops waiting on an engine that left), the
(re)forming of the transport with exactly that set, and the calls made to every engine
at once with their errors gathered (pause, resume, the commit, weight-update sessions).

What differs per transport comes in through :class:`Formation` (form and tear down the
transport with ``clients``, and how long a client may wait on an engine's answer); the
senders (``collective_send``, ``cuda_ipc_send``) own their transfer.

Errors: a call that failed on some engines raises :class:`WeightSyncError` naming each;
anything but an engine's own answer (unreachable, group error) also marks the group
broken (``formed = False``), so the next push re-forms it first.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from asyncrl.config import CollectiveWeightsConfig, CudaIpcWeightsConfig
from asyncrl.loops import new_event_loop
from asyncrl.transports.weights.base import EnginesLeft, PushHandle, WeightSyncError
from asyncrl.transports.weights.pausing import pause_engines, resume_engines, traced
from asyncrl.transports.weights.seam import EngineError, WeightAdapter, WeightEngine

__all__ = ["EngineGroup", "Formation", "GroupSender", "settle"]

log = logging.getLogger("asyncrl.weights")


def settle(last: PushHandle | None, timeout_s: float) -> None:
    """Before a sender closes: wait up to ``timeout_s`` for its push in flight (``last``);
    a push that fails or does not end in time is logged, not raised (the sender is closing)."""
    if last is None or last.done():
        return
    try:
        last.wait(timeout_s)
    except (WeightSyncError, TimeoutError) as exc:
        log.warning("closing with a failed push: %s", exc)


T = TypeVar("T")


class Formation(Protocol):
    """A transport's part in (re)forming the group (called on the group's loop, locked)."""

    async def form(self) -> None:
        """Form the transport with every engine of ``group.clients`` (all healthy now)."""
        ...

    async def teardown(self) -> None:
        """Undo ``form`` (best effort: engines may be gone)."""
        ...

    def client_timeout_s(self) -> float:
        """How long an engine's answer may take (an answer may wait for a whole push)."""
        ...


class GroupSender:
    """What every sender whose engines are an :class:`EngineGroup` (``self.engines``)
    answers of :class:`~asyncrl.transports.weights.base.WeightTransport` the same way."""

    engines: EngineGroup

    def connect(self, engine_urls: Sequence[str] | None = None) -> None:
        """Form the group (again, with ``engine_urls`` when given); blocks until formed."""
        self.engines.connect(engine_urls)

    def engines_changed(self, engine_urls: Sequence[str], epoch: int) -> None:
        """The run's engine set changed (see ``base``); any thread, returns at once."""
        self.engines.engines_changed(engine_urls, epoch)


class EngineGroup:
    """Every engine of the run's engine set, as one group (see module docstring).

    ``clients``, ``formed`` and every ``async`` method belong to the group's loop: call
    them from coroutines given to :meth:`run`. ``connect``, ``engines_changed`` and
    ``close`` are for the owner's thread.
    """

    def __init__(
        self,
        engine_urls: Sequence[str],
        cfg: CollectiveWeightsConfig | CudaIpcWeightsConfig,
        formation: Formation,
        family: WeightAdapter,
        pause_mode: str = "abort",
    ):
        if not engine_urls:
            raise ValueError("weight sync needs at least one engine URL")
        self.urls = list(engine_urls)
        self.cfg = cfg
        self.pause_mode = pause_mode
        self.family = family
        self.loads_live = family.loads_live
        """Engines that load buckets as they arrive (SGLang, vLLM): a failed push leaves
        them undefined."""
        self.pause_scope = "transfer" if self.loads_live else cfg.pause_scope
        self.clients: list[WeightEngine] = []
        self.formed = False
        self.pauses = 0  # pause calls made (to every engine at once), for push stats
        self.lock: asyncio.Lock | None = None  # pushes and re-forms, one at a time
        self._formation = formation
        self._loop = new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="weight-sender", daemon=True
        )
        self._epoch = 0  # of the newest engine set told (engines_changed)
        self._op: asyncio.Task[Any] | None = None  # the push attempt or re-form under way
        self._left: list[str] = []  # engines it involved that left the set (it was cancelled)

    @property
    def kept(self) -> str:
        """What a failed push left on the engines, for error messages."""
        return "weights undefined" if self.loads_live else "kept old weights"

    # -- the loop ------------------------------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Run ``coro`` on the group's loop (started on first use); returns at once."""
        if not self._thread.is_alive():
            self._thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def connect(self, engine_urls: Sequence[str] | None = None) -> None:
        """Form the transport (again, with ``engine_urls`` when given, else with the current
        set); blocks until formed."""
        if engine_urls is not None and not engine_urls:
            raise ValueError("weight sync needs at least one engine URL")
        self.run(self.reform(None if engine_urls is None else list(engine_urls))).result()

    def engines_changed(self, engine_urls: Sequence[str], epoch: int) -> None:
        """The run's engine set is now ``engine_urls``, its ``epoch``-th change (see base):
        the next push or re-form uses it; one under way stops waiting on an engine not in
        it. Safe from any thread; returns at once (an older ``epoch`` is ignored)."""
        urls = list(engine_urls)
        if not urls:
            raise ValueError("weight sync needs at least one engine URL")
        self._loop.call_soon_threadsafe(self._set_engines, urls, epoch)

    def close(self) -> None:
        """Tear the transport down, close the clients and stop the loop's thread."""
        if self._thread.is_alive():
            try:
                self.run(self.shutdown()).result(timeout=30)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)

    def _set_engines(self, urls: list[str], epoch: int) -> None:
        """On the group's loop: take the set (see ``engines_changed``)."""
        if epoch < self._epoch:
            return
        self._epoch = epoch
        if urls == self.urls:
            return
        log.info("engine set %d: %s (was %s)", epoch, urls, self.urls)
        self.urls = urls
        self.formed = False  # the next push forms the group with exactly these engines
        op = self._op
        left = [c.url for c in self.clients if c.url not in urls]
        if left and op is not None and not op.done():
            self._left = left
            op.cancel()

    # -- forming -------------------------------------------------------------------------
    async def guarded(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` (a push attempt or a re-form) as the operation under way; when an
        engine it involves leaves the set, it is cancelled and :class:`EnginesLeft` raised
        naming the engine(s), instead of waiting on them (see ``_set_engines``)."""
        task = asyncio.ensure_future(coro)
        self._op, self._left = task, []
        try:
            return await task
        except asyncio.CancelledError:
            outer = getattr(asyncio.current_task(), "cancelling", None)  # Python 3.11+
            if not self._left or not task.cancelled() or (outer is not None and outer()):
                raise  # cancelled from outside (shutdown): not ours to turn into an error
            raise EnginesLeft(self._left, self.urls) from None
        finally:
            self._op = None

    def locked(self) -> asyncio.Lock:
        """The lock pushes and re-forms hold (made on the group's loop, on first use)."""
        if self.lock is None:
            self.lock = asyncio.Lock()
        return self.lock

    async def reform(self, urls: list[str] | None = None) -> None:
        """Form the transport with ``urls`` (default: the current set), again as long as
        engines leave the set meanwhile."""
        async with self.locked():
            if urls is not None:
                self.urls = urls
            while True:  # again only after the set changed (an engine left meanwhile)
                try:
                    await self.guarded(self.reform_locked())
                    return
                except EnginesLeft as exc:
                    log.warning("%s; forming the weight group with %s", exc, self.urls)

    async def reform_locked(self) -> None:
        """Tear down, make a client per engine, wait until each is healthy, form."""
        await self.shutdown()
        wait_s = self._formation.client_timeout_s()
        self.clients = [self.family.engine(u, wait_s) for u in self.urls]
        await asyncio.gather(*(c.wait_healthy(self.cfg.timeout_s) for c in self.clients))
        await self._formation.form()
        self.formed = True

    async def shutdown(self) -> None:
        """Tear the transport down (when formed) and close every client."""
        if self.formed:
            self.formed = False
            await self._formation.teardown()
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
        self.clients = []

    # -- calls to every engine -----------------------------------------------------------
    async def all(self, what: str, call: Callable[[WeightEngine], Awaitable[Any]]) -> None:
        """``call(client)`` on every engine at once (traced as ``what``); WeightSyncError
        naming each engine that failed."""
        results = await asyncio.gather(
            *(traced(what, c.url, call(c)) for c in self.clients), return_exceptions=True
        )
        self._raise_any(
            what,
            [(c.url, r) for c, r in zip(self.clients, results, strict=True)
             if isinstance(r, BaseException)],
        )  # fmt: skip

    def _raise_any(self, what: str, errors: list[tuple[str, BaseException]]) -> None:
        if errors:
            if any(not isinstance(e, EngineError) for _, e in errors):
                self.formed = False  # an engine unreachable (died?): re-form next time
            detail = "; ".join(f"{u}: {e}" for u, e in errors)
            raise WeightSyncError(f"{what} failed on {len(errors)} engine(s): {detail}")

    async def pause(self) -> None:
        """Pause generation on every engine (``pause_mode``, :func:`pausing.pause_engines`)."""
        self.pauses += 1
        failed = await pause_engines(self.clients, self.pause_mode)
        self._raise_any("/pause_generation", [(c.url, r) for c, r in failed])

    async def resume(self) -> None:
        """Resume generation on every engine; a failure is logged, not raised."""
        for c, r in await resume_engines(self.clients):
            log.warning("could not resume %s: %s", c.url, r)

    async def commit(self, version: int) -> None:
        """Make every engine version ``version`` (the embedded engine: switch to the staged
        update; vLLM: confirm its finish set it); engines paused only around it when
        ``pause_scope="commit"``."""
        paused = self.pause_scope == "commit"
        if paused:
            await self.pause()
        try:
            await self.all(
                "/update_weight_version", lambda c: c.update_weight_version(str(version))
            )
        finally:
            if paused:
                await self.resume()

    async def begin_sessions(self) -> None:
        """Open a weight-update session on every engine (SGLang 0.5.22+, vLLM; a no-op
        elsewhere); a session a failed push left open is closed and the call tried once
        more."""
        try:
            await self.all("/begin_weight_update", lambda c: c.begin_weight_update())
        except WeightSyncError:
            await self.end_sessions()
            await self.all("/begin_weight_update", lambda c: c.begin_weight_update())

    async def end_sessions(self, version: int | None = None) -> None:
        """Close the weight-update session on every engine (``version``: what its buckets
        made, for engines that set it on close, e.g. vLLM's finish); a failure is logged
        (such an engine then refuses the commit)."""
        label = None if version is None else str(version)
        results = await asyncio.gather(
            *(c.end_weight_update(label) for c in self.clients), return_exceptions=True
        )
        for c, r in zip(self.clients, results, strict=True):
            if isinstance(r, BaseException):
                log.warning("could not end the weight-update session on %s: %s", c.url, r)

    def raise_failed(self, results: list[tuple[str, Any]], prefix: str = "") -> None:
        """Raise WeightSyncError naming the engines whose result is an exception, if any;
        anything but an engine's own answer (unreachable, group error) breaks the group."""
        errors = [(u, r) for u, r in results if isinstance(r, BaseException)]
        if errors:
            if any(not isinstance(e, EngineError) for _, e in errors):
                self.formed = False
            detail = "; ".join(f"{u}: {e}" for u, e in errors[:4])
            raise WeightSyncError(
                f"{prefix}{len(errors)} engine(s) failed the update ({self.kept}): {detail}"
            )
