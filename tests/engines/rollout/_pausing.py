"""Pausing the embedded engine while its requests are in flight."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

from asyncrl.engines.rollout.local.engine import LocalEngine, Request

Submit = Callable[[], "list[Request] | Awaitable[list[Request]]"]


async def pause_in_flight(
    engine: LocalEngine, submit: Submit, n: int, mode: str, attempts: int = 5
) -> list[Request]:
    """Submit requests (``submit()``), pause ``engine`` (``mode``) once each has ``n`` tokens,
    and return them paused with none of them finished.

    Watched from a thread of its own. Still, the engine's scheduler thread (short GIL
    releases around every torch op) can keep a waiting Python thread off the GIL for a
    fraction of a second, in which a tiny model decodes hundreds of tokens; when every
    request finished before the pause, the attempt proves nothing and is made again.
    """
    for _ in range(attempts):
        reqs = submit()
        if inspect.isawaitable(reqs):
            reqs = await reqs
        await asyncio.to_thread(_watch_and_pause, engine, reqs, n, mode)
        if all(r.finish is None for r in reqs):
            return reqs
        engine.resume()  # too late: let them finish and try again
        await asyncio.gather(*(r.future for r in reqs))
    raise AssertionError(f"could not pause the engine mid-flight in {attempts} attempts")


def _watch_and_pause(engine: LocalEngine, reqs: list[Request], n: int, mode: str) -> None:
    deadline = time.monotonic() + 20
    while min(len(r.output_ids) for r in reqs) < n:
        if time.monotonic() > deadline:
            raise AssertionError("no progress")
        time.sleep(0.0002)
    engine.pause(mode)
