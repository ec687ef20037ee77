"""What the controller's engine set (``membership.py``) needs of the run's launcher, defined
below the launchers that implement it: :class:`Death`, a process of the run that exited,
and :class:`Restarter`, which starts one again. ``launchers.base.Launcher`` is a Restarter
and reports its processes' exits as Deaths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["Death", "Restarter"]


@dataclass(frozen=True)
class Death:
    """A process of the run that exited while the run still needed it."""

    name: str
    """``engine{i}`` or ``trainer{r}``."""
    code: int | None
    """Exit status (negative: killed by that signal); None when unknown (a lost node)."""
    log_tail: str
    """The last lines of its log, for the error message."""

    def describe(self) -> str:
        return f"{self.name} exited with {self.code}:\n{self.log_tail}"


class Restarter(Protocol):
    """Starts one process of the run again.

    Contract: ``restart(name)`` starts process ``name`` (``engine{i}``) again with the same
    arguments and returns its URL once started (not yet answering; it may differ from the
    old one on a cluster); it blocks, so the engine set calls it in a thread.
    """

    def restart(self, name: str) -> str:
        """Start process ``name`` again; its new URL (engines) or ``""`` (trainers)."""
        ...
