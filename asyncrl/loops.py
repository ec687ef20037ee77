"""The event loop of every asyncrl process: uvloop's when installed, else asyncio's.

uvloop lowers the latency of each control call (HTTP, ZeroMQ, weight-sync
handshakes); it is optional, and without it asyncio's own loop runs the same code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from types import ModuleType
from typing import Any, TypeVar

__all__ = ["new_event_loop", "run"]

T = TypeVar("T")


def _uvloop() -> ModuleType | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new loop: uvloop's when installed, else asyncio's."""
    uvloop = _uvloop()
    return uvloop.new_event_loop() if uvloop else asyncio.new_event_loop()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)`` on :func:`new_event_loop`'s kind of loop."""
    uvloop = _uvloop()
    return uvloop.run(coro) if uvloop else asyncio.run(coro)
