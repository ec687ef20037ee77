"""Restart budgets as rates: at most N restarts in any window of W seconds.

A lifetime count ends any long run that meets an occasional fault (a run of days with a
trainer fault an hour used up ``trainer.max_restarts=2`` on its third hour); a rate
ends only a run whose faults come faster than it can make progress between them.

Contract: :meth:`RestartBudget.take` records one restart at ``now`` and answers whether it
is within the budget, i.e. whether at most ``limit`` restarts (this one included) fall in
the half-open window ``(now - window_s, now]``. A refused restart is not recorded. With
``window_s`` = 0 the window is the whole run (a lifetime count, the old rule). The clock
is the caller's (``time.monotonic`` in a run, a virtual one in tests): nothing here reads
time or sleeps.
"""

from __future__ import annotations

from collections import deque

__all__ = ["RestartBudget"]


class RestartBudget:
    """``limit`` restarts per ``window_s`` seconds (0: per run)."""

    def __init__(self, limit: int, window_s: float) -> None:
        if limit < 0 or window_s < 0:
            raise ValueError(f"a restart budget needs limit, window_s >= 0: {limit}, {window_s}")
        self.limit = limit
        self.window_s = window_s
        self.times: deque[float] = deque()
        self.total = 0
        """Restarts granted over the whole run."""

    def in_window(self, now: float) -> int:
        """Restarts granted in the window that ends at ``now``."""
        if self.window_s > 0:
            while self.times and self.times[0] <= now - self.window_s:
                self.times.popleft()
        return len(self.times)

    def take(self, now: float) -> bool:
        """Record a restart at ``now`` if the budget allows it; whether it did."""
        if self.in_window(now) >= self.limit:
            return False
        self.times.append(now)
        self.total += 1
        return True

    def describe(self) -> str:
        """The budget in words, for the error that ends a run."""
        per = f"per {self.window_s:g} s" if self.window_s > 0 else "per run"
        return f"{self.limit} restart(s) {per}"
