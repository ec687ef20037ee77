"""The run's rollout engines as a set that can change: an engine that dies is restarted,
re-synced and put back in rotation, while the run goes on.

Contract (driver side; no torch):

- :meth:`EngineSet.revive` handles one engine's death: it takes the engine out of
  rotation (held), has the launcher start it again (``rollout.max_restarts`` times
  per engine; one more death takes it out of the run for good, and when no engine
  is left the run stops with an error naming each), waits until it answers ``/health``,
  swaps the router's client when the URL changed (Ray may place it on another node),
  and tells every trainer rank the new engine set (:class:`Engines`, numbered by
  ``epoch``) twice: at once as a notice (``ExperienceSender.notify``: rank 0's weight
  sender takes the set for its next push, and a push under way stops waiting on an
  engine that left it, while the trainer is mid-step), and between two steps' messages
  (``send_lock``) for the re-sync below. The set told leaves out engines being
  restarted (``live_urls``; a notice at the death already), so pushes go on to the
  others while one restarts, unless every engine is restarting (an outage: then a push
  waits for them).
- Trainer rank 0 re-forms the weight group with that set before its next push and
  pushes the current weights; its :class:`EnginesSynced` answer is handed to
  :meth:`EngineSet.synced`, which puts the engines that were waiting for weights
  back in rotation (each recorded: detection and admission times, the version it got).
  A failed re-sync fails the run (the engine answers ``/health`` but cannot take
  weights: nothing left to retry).

Restart decisions are made here, never by Ray (its actors are never restarted).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from asyncrl.config import RunConfig
from asyncrl.controllers.deaths import Death, Restarter
from asyncrl.controllers.restarts import RestartBudget
from asyncrl.controllers.router import Router
from asyncrl.engines.rollout.base import ManagedEngine
from asyncrl.engines.rollout.factory import make_engine
from asyncrl.transports.experience.control import Engines, EnginesSynced

__all__ = ["EngineSet"]

log = logging.getLogger("asyncrl.membership")


class EngineSet:
    """Clients of the run's engines by process name (``engine{i}``), in order."""

    def __init__(
        self,
        cfg: RunConfig,
        launcher: Restarter,
        urls: list[str],
        record: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.cfg = cfg
        self.launcher = launcher
        self.record = record  # each engine back in rotation (the run's recoveries.jsonl)
        self.died_at: dict[str, tuple[str, int, float]] = {}  # url -> name, restart, wall time
        self.startup_s = cfg.rollout.startup_timeout_s or 120.0  # the run sets the scaled one
        self.clients = {f"engine{i}": make_engine(cfg.rollout, u) for i, u in enumerate(urls)}
        self.budgets: dict[str, RestartBudget] = {}  # per engine: max_restarts per window
        self.gone: dict[str, str] = {}  # engines out of the run for good: why
        self.waiting: dict[str, ManagedEngine] = {}  # url -> client held until re-synced
        self.send_lock = asyncio.Lock()  # one step's messages, or one Engines, at a time
        self.epoch = 0  # changes of the engine set told to the trainer (Engines.epoch)
        self.down: set[str] = set()  # engines being restarted: left out of the set told

    def urls(self) -> list[str]:
        return [c.url for c in self.clients.values()]

    def live_urls(self) -> list[str]:
        """The set told to the trainer (weight pushes go there): the run's engines but those
        being restarted; all of them when every one is (then a push waits for them, within
        ``weights.timeout_s``: an outage)."""
        return [c.url for n, c in self.clients.items() if n not in self.down] or self.urls()

    async def revive(self, death: Death, router: Router, chan: Any) -> None:
        """Restart the engine of ``death`` and start its re-sync; raises RuntimeError when
        it may not be restarted (again)."""
        name = death.name
        rc = self.cfg.rollout
        if name not in self.clients:
            raise RuntimeError(f"{death.describe()}\n(not ours to restart)")
        budget = self.budgets.setdefault(name, RestartBudget(rc.max_restarts, rc.restart_window_s))
        if not budget.take(time.monotonic()):
            await self.give_up(name, death, router, chan)
            return
        count = budget.total  # restarts of this engine over the run, this one included
        in_window = budget.in_window(time.monotonic())
        old = self.clients[name]
        detected = time.time()
        router.hold(old)
        self.waiting.pop(old.url, None)  # died again before its re-sync: not admitted by it
        per = f" per {rc.restart_window_s:g} s" if rc.restart_window_s > 0 else ""
        log.warning(
            "%s exited with %s; restart %d of %d%s (%d over the run)",
            name, death.code, in_window, rc.max_restarts, per, count,
        )  # fmt: skip
        self.down.add(name)
        if len(self.live_urls()) < len(self.clients):  # pushes go on to the others meanwhile
            self.notify(chan)
        url = await asyncio.to_thread(self.launcher.restart, name)
        client = old if url == old.url else make_engine(self.cfg.rollout, url)
        await client.wait_healthy(self.startup_s)
        self.down.discard(name)
        if client is not old:
            router.remove(old)
            router.add(client, held=True)
            self.clients[name] = client
            await old.close()
        self.waiting[url] = client
        self.died_at[url] = (name, count, detected)
        await self.announce(chan)

    async def give_up(self, name: str, death: Death, router: Router, chan: Any) -> None:
        """``name`` died once more than ``rollout.max_restarts`` per ``restart_window_s``
        allows: it leaves the run (router, weight group); RuntimeError when it was the last
        engine."""
        rc = self.cfg.rollout
        limit = rc.max_restarts
        count = self.budgets[name].total if name in self.budgets else 0
        client = self.clients.pop(name)
        self.down.discard(name)
        self.gone[name] = f"{death.describe()} (restarted {count} times)"
        if not self.clients:
            per = f" per {rc.restart_window_s:g} s" if rc.restart_window_s > 0 and limit else ""
            raise RuntimeError(
                "no rollout engine left (each died more than rollout.max_restarts="
                f"{limit} times{per}):\n" + "\n".join(f"{n}: {w}" for n, w in self.gone.items())
            )
        log.error(
            "%s exited with %s after %d restarts: out of the run; %d engine(s) left",
            name, death.code, count, len(self.clients),
        )  # fmt: skip
        router.remove(client)
        self.waiting.pop(client.url, None)
        await self.announce(chan)
        await client.close()

    def notify(self, chan: Any) -> Engines:
        """Tell every trainer rank the engine set now (``live_urls``, the next ``epoch``) at
        once, over its control connection: rank 0's weight sender takes it for its next
        push and stops waiting on an engine not in it (see ``ExperienceSender.notify``)."""
        self.epoch += 1
        msg = Engines(urls=self.live_urls(), epoch=self.epoch)
        chan.notify(msg)
        return msg

    async def announce(self, chan: Any) -> None:
        """:meth:`notify`, then the same message in order between two steps' messages: the
        trainer re-forms the weight group with it and re-syncs (``EnginesSynced``)."""
        msg = self.notify(chan)
        async with self.send_lock:
            await chan.broadcast(msg)

    def synced(self, msg: EnginesSynced, router: Router) -> list[str]:
        """Trainer rank 0 re-synced ``msg.urls``: engines waiting for it go back in rotation;
        their URLs. Raises RuntimeError when the re-sync failed."""
        if msg.error:
            raise RuntimeError(f"re-sync of engines {msg.urls} failed: {msg.error}")
        back = [u for u in msg.urls if u in self.waiting]
        now = time.time()
        for url in back:
            router.admit(self.waiting.pop(url))
            log.warning("%s back in rotation at weight version %d", url, msg.version)
            name, count, detected = self.died_at.pop(url, ("?", 0, now))
            if self.record is not None:
                self.record(
                    {
                        "engine": name,
                        "restart": count,
                        "version": msg.version,
                        "detected_at": detected,
                        "admitted_at": now,
                        "detect_to_admitted_s": now - detected,
                    }
                )
        return back

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients.values()), return_exceptions=True)
