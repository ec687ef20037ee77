"""How the controller reacts to groups that end without training: streaks and their bound.

Contract: the controller counts every group's end itself (``Controller._release``); it
tells :class:`Streaks` of each group that failed (:meth:`Streaks.failed`), was rejected
(:meth:`Streaks.rejected`) or became ready (:meth:`Streaks.reset`). :class:`Streaks` logs
those at a bounded rate (:class:`RateLimitedLog`) and raises :class:`GroupsFailing` once
``controller.max_failed_groups`` groups in a row failed or were rejected, none becoming
ready between them (an :class:`~asyncrl.controllers.episode.EngineKeyRefused` at the
first: no group can succeed). It raises, never swallows: the group's supervised task
carries the error to ``next_batch``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from asyncrl.controllers.calls import EngineKeyRefused, EpisodeFailed

__all__ = ["GroupsFailing", "RateLimitedLog", "Streaks"]


class GroupsFailing(RuntimeError):
    """``controller.max_failed_groups`` groups in a row failed or were rejected, none
    finishing between them: the run cannot train (every request fails the same way, every
    agent raises, every episode returns None). The message names the last cause; the run
    stops with it."""


class RateLimitedLog:
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


class Streaks:
    """The groups failed or rejected since the last one that became ready (see the module
    docstring). ``logger``: where the warnings go (the controller's)."""

    def __init__(self, logger: logging.Logger, batch_size: int, max_failed_groups: int):
        self._batch_size = batch_size
        self._max_failed_groups = max_failed_groups
        self.failed_streak = 0
        self.rejected_streak = 0
        self._failure_log = RateLimitedLog(logger, first=5, every_s=10.0)
        self._reject_log = RateLimitedLog(logger, first=1, every_s=30.0)

    def reset(self) -> None:
        """A group became ready: both streaks end."""
        self.failed_streak = self.rejected_streak = 0

    def rejected(self, gid: int, cause: str) -> None:
        """Group ``gid`` was rejected (every episode returned None or raised
        :class:`EpisodeRejected`, ``cause``: the last one's message); warn (at a bounded rate)
        while every group is rejected: ``next_batch`` would wait for groups that never come;
        stop as :meth:`failed` once the streak reaches the bound."""
        self.rejected_streak += 1
        why = cause or "every episode returned None"
        if self.rejected_streak >= self._batch_size:
            self._reject_log.warning(
                "%d groups in a row rejected (%s; the last group %d): "
                "next_batch gets no batch while that goes on",
                self.rejected_streak,
                why,
                gid,
            )
        self._failing(f"group {gid} rejected: {why}", None)

    def failed(self, gid: int, exc: EpisodeFailed) -> None:
        """Group ``gid`` failed (logged at a bounded rate); raise :class:`GroupsFailing` once
        the streak reaches the bound, ``exc`` itself when it is an :class:`EngineKeyRefused`."""
        self._failure_log.warning("group %d failed: %s", gid, exc)
        if isinstance(exc, EngineKeyRefused):  # no group can succeed: stop at the first
            raise exc
        self._failing(str(exc), exc)

    def _failing(self, cause: str, exc: BaseException | None) -> None:
        """One more group failed or rejected since the last that became ready: at
        ``controller.max_failed_groups`` in a row, raise :class:`GroupsFailing` naming
        ``cause`` (the last)."""
        self.failed_streak += 1
        if self._max_failed_groups and self.failed_streak >= self._max_failed_groups:
            raise GroupsFailing(
                f"{self.failed_streak} groups in a row failed or were rejected and none "
                f"finished (controller.max_failed_groups); the last: {cause}"
            ) from exc
