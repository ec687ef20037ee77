"""Staleness-paced admission (AReaL's rule) and the per-step staleness check.

A group (GRPO: ``group_size`` episodes of one sample) may be admitted only while

    admitted - released < (max_staleness + version + 1) * batch_size

where ``version`` is the policy version live on the engines, ``admitted`` counts
every group ever admitted and ``released`` the groups that left without being
trained (rejected, dropped, failed). Groups admitted and not released are exactly
the accepted + running ones. On resume at version ``v`` the counters restart
from ``admitted = v * batch_size`` (the groups the first ``v`` steps trained), not
from zero. ``max_staleness = 0`` is synchronous training through the same rule.

The rule paces generation; it cannot by itself order completions, so the batch
former re-checks every group with :meth:`Staleness.fits` before step ``t``
trains it: ``t - min_version <= max_staleness``.

Dynamic sampling (``algo.filter_groups``) adds ``ahead`` slots to the capacity: the groups it
expects to drop among those in flight, admitted at once so their refill runs beside them
instead of after they finished (the controller sets it from the share it dropped lately).
Those groups are bounded the same way at batch time (``fits``).
"""

from __future__ import annotations

__all__ = ["Staleness"]


class Staleness:
    """Admission counters and the staleness predicate. Not thread-safe (one event loop)."""

    def __init__(self, max_staleness: int, batch_size: int, version: int = 0):
        if max_staleness < 0 or batch_size <= 0:
            raise ValueError("max_staleness must be >= 0 and batch_size > 0")
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.version = version
        self.admitted = version * batch_size
        self.released = 0
        self.ahead = 0  # extra slots for groups dynamic sampling is expected to drop

    @property
    def capacity(self) -> int:
        return (self.max_staleness + self.version + 1) * self.batch_size + self.ahead

    @property
    def in_flight(self) -> int:
        """Groups admitted and neither trained-away nor released (running + accepted)."""
        return self.admitted - self.released

    def can_admit(self) -> bool:
        return self.in_flight < self.capacity

    def admit(self) -> None:
        assert self.can_admit(), "admit() past capacity"
        self.admitted += 1

    def release(self) -> None:
        """A group left without being trained: its slot is free again."""
        self.released += 1

    def set_version(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"policy version went back from {self.version} to {version}")
        self.version = version

    def fits(self, step: int, min_version: int) -> bool:
        """May a sample whose oldest token is from ``min_version`` train at ``step``?"""
        return step - min_version <= self.max_staleness
