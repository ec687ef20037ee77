"""The run's progress line: step, reward, tokens/s, ETA.

``step 12/120 | reward 0.512 (last 10: 0.480) | staleness 1 | 1,234 tok/s | train 0.21s |
sync 0.004s | 31s | ETA 280s``: the step's mean reward and the mean of the last 10 steps'
(fewer at the start), the step's largest staleness, response tokens per second since the
first step, the step's train and weight-sync seconds, the wall time and the time left at
the pace since the first step. Once the run has evaluated (``[eval]``) the step line also
says ``eval 0.812@v10``: the newest held-out reward and the weight version it measured, and
each eval prints a line of its own (:meth:`Progress.eval`).

On a terminal one line is rewritten in place (``\\r``); otherwise (CI logs,
pipes, files) every step prints one plain line, so logs stay readable.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Any, TextIO

__all__ = ["Progress"]


class Progress:
    """Reports steps of a run of ``total`` steps to ``out`` (default stdout)."""

    WINDOW = 10
    """Steps the line's running mean of the reward covers."""

    def __init__(self, total: int, out: TextIO | None = None, live: bool | None = None):
        self.total = total
        self.out = out or sys.stdout
        self.live = self.out.isatty() if live is None else live
        self._recent: deque[float] = deque(maxlen=self.WINDOW)
        self._t_first: float | None = None
        self._tokens = 0
        self._width = 0
        self._eval: tuple[float, int] | None = None

    def line(self, row: dict[str, Any]) -> str:
        """The text for a metrics row (also updates the running averages)."""
        step, wall = int(row["step"]), float(row["wall_s"])
        r = float(row["reward_mean"])
        self._recent.append(r)
        recent = sum(self._recent) / len(self._recent)
        tokens_s = eta = None
        if self._t_first is None:
            self._t_first = wall
        else:
            self._tokens += int(row.get("response_tokens", 0))
            span = wall - self._t_first
            done = step  # steps reported since the first one
            if span > 0 and done > 0:
                tokens_s = self._tokens / span
                eta = span / done * (self.total - step - 1)
        parts = [
            f"step {step + 1}/{self.total}",
            f"reward {r:.3f} (last {len(self._recent)}: {recent:.3f})",
            *([f"eval {self._eval[0]:.3f}@v{self._eval[1]}"] if self._eval else []),
            f"staleness {row.get('staleness_max', 0)}",
            f"{tokens_s:,.0f} tok/s" if tokens_s is not None else "- tok/s",
            f"train {float(row.get('train_s', 0.0)):.2f}s",
            f"sync {float(row.get('sync_s', 0.0)):.3f}s",
            f"{wall:.0f}s",
            f"ETA {eta:.0f}s" if eta is not None else "ETA -",
        ]
        return " | ".join(parts)

    def update(self, row: dict[str, Any]) -> None:
        text = self.line(row)
        if self.live:
            pad = max(0, self._width - len(text))
            self._width = len(text)
            end = "\n" if int(row["step"]) + 1 >= self.total else ""
            self.out.write("\r" + text + " " * pad + end)
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def eval(self, row: dict[str, Any]) -> None:
        """Report an eval's metrics row (``eval/...`` keys, ``step`` = the version evaluated)
        on a line of its own; later step lines carry its reward."""
        version, reward = int(row["step"]), float(row["eval/reward_mean"])
        self._eval = (reward, version)
        parts = [f"eval of v{version}", f"reward {reward:.3f}"]
        parts += [
            f"{key.removeprefix('eval/')} {float(val):.3f}"
            for key, val in sorted(row.items())
            if key.startswith("eval/pass@")
        ]
        if "eval/greedy_reward" in row:
            parts.append(f"greedy {float(row['eval/greedy_reward']):.3f}")
        text = " | ".join(parts)
        if self.live and self._width:  # keep the live step line: the eval goes above it
            self.out.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.out.write(text + "\n")
        self.out.flush()

    def close(self) -> None:
        """End a live line that is still open (a run that stopped early)."""
        if self.live and self._width:
            self.out.write("\n")
            self.out.flush()
            self._width = 0
