"""Pausing generation around a weight update: the one place engines are paused and resumed.

Every pause of a weight update goes through :func:`pause_engines` / :func:`resume_engines`:
the weight transport's engine group (``send_engines.EngineGroup``, for ``asyncrl run``'s
trainer and the embedding API's :class:`~asyncrl.WeightPusher`) and
``Controller.weight_update`` (weights loaded the user's own way) and ``Controller.interrupt``
(a checkpoint before a stop). Each call reaches every engine at once, traced on the engine's
track, and answers which engines failed, with their errors; what a failure means is the
caller's (the engine group raises, the controller reports the engine to its router). Runs
in any process; imports no torch and no engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol, TypeVar

from asyncrl import trace

__all__ = ["Pausable", "pause_engines", "resume_engines"]


class Pausable(Protocol):
    """An engine whose generation can be paused: ``pause_generation(mode)`` stops scheduling
    (``abort``: requests in flight return their partial output at once; other modes keep
    them), ``continue_generation`` resumes; both raise the engine's errors."""

    url: str

    async def pause_generation(self, mode: str = "abort") -> None: ...

    async def continue_generation(self) -> None: ...


E = TypeVar("E", bound=Pausable)


async def pause_engines(engines: Sequence[E], mode: str) -> list[tuple[E, BaseException]]:
    """Pause every engine of ``engines`` at once with ``mode``; the ones that failed."""
    calls = [traced("/pause_generation", e.url, e.pause_generation(mode)) for e in engines]
    return _failed(engines, await asyncio.gather(*calls, return_exceptions=True))


async def resume_engines(engines: Sequence[E]) -> list[tuple[E, BaseException]]:
    """Let every engine of ``engines`` continue, at once; the ones that failed."""
    calls = [traced("/continue_generation", e.url, e.continue_generation()) for e in engines]
    return _failed(engines, await asyncio.gather(*calls, return_exceptions=True))


async def traced(what: str, url: str, call: Awaitable[Any]) -> Any:
    """``call`` to the engine at ``url`` as a span of that engine's track."""
    with trace.get().span(what, f"engine {url}"):
        return await call


def _failed(engines: Sequence[E], results: list[Any]) -> list[tuple[E, BaseException]]:
    return [(e, r) for e, r in zip(engines, results, strict=True) if isinstance(r, BaseException)]
