"""The controller's weight-update and interrupt path: quiesce the engines, then let them go on.

Contract: :meth:`Quiescer.paused` holds the engines still around a weight update in one of
the pause modes (``abort`` / ``retract`` / ``in_place`` pause them, through
``transports/weights/pausing.py``, the one place engines are paused; ``wait`` pauses none:
it holds new requests at the :class:`~asyncrl.controllers.calls.Gate` and waits for the
ones in flight) and always lets them continue on leaving, even when the update raised.
:meth:`Quiescer.interrupt` brings every running request's tokens into its episode's
journal before a stop (see ``Controller.interrupt``). An engine's error, or an engine
down, goes to the router; nothing else is swallowed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from asyncrl.controllers.calls import Gate
from asyncrl.controllers.router import Router
from asyncrl.engines.rollout.base import EngineError, EngineUnavailable, RolloutEngine
from asyncrl.transports.weights.pausing import pause_engines, resume_engines

__all__ = ["Quiescer"]


class Quiescer:
    """Pauses and resumes ``router``'s engines; ``gate``: the one the episodes share."""

    def __init__(self, router: Router, gate: Gate):
        self._router, self._gate = router, gate

    @contextlib.asynccontextmanager
    async def paused(self, mode: str) -> AsyncIterator[None]:
        """The engines quiet in ``mode`` (a valid one: the caller checks) while the block
        runs; the gate open and the engines continuing after it, always."""
        engines = self._router.engines
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

    async def interrupt(self, timeout_s: float) -> bool:
        """Close the gate, abort every engine's requests and let the engines continue; True
        when every request in flight answered within ``timeout_s`` (``Controller.interrupt``
        says why the engines continue before the wait)."""
        self._gate.open.clear()
        engines = self._router.engines
        self._failed(await pause_engines(engines, "abort"))
        self._failed(await resume_engines(engines))
        try:
            await asyncio.wait_for(self._gate.drained.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def _failed(self, failed: list[tuple[RolloutEngine, BaseException]]) -> None:
        """Engines a pause or resume failed on: an engine's error or an engine down goes to
        the router (a down engine is not paused: fine); anything else is raised."""
        for engine, exc in failed:
            if not isinstance(exc, EngineError | EngineUnavailable):
                raise exc
            self._router.report_failure(engine, exc)
