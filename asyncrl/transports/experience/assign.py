"""Which trainer rank gets which GRPO group: an explicit, deterministic assignment policy.

A group is the unit of assignment: every trajectory of a group goes to the same
rank, so group-relative advantages are computed on one rank. Two policies:

- ``modulo``: rank = group_id mod world_size. Stateless, so several producers
  that stream trajectories of one group separately still agree on its rank.
- ``balanced``: for one train step's groups, group counts per rank differ by at
  most one, and within that the rank with the fewest tokens so far takes the
  next largest group (greedy longest-processing-time). Evens out the ranks' work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from asyncrl.core import Trajectory

__all__ = ["Assigner", "BalancedAssigner", "ModuloAssigner", "make_assigner"]


class Assigner(Protocol):
    """Maps whole groups to ranks."""

    def assign(self, groups: Sequence[Sequence[Trajectory]], world_size: int) -> list[int]:
        """Rank in ``[0, world_size)`` of each group (same order as ``groups``).

        Contract: deterministic for the same input; a group is never split (it
        has exactly one rank).
        """
        ...


class ModuloAssigner:
    """rank = group_id mod world_size (the first trajectory's group id names the group)."""

    def assign(self, groups: Sequence[Sequence[Trajectory]], world_size: int) -> list[int]:
        return [(g[0].group_id if g else 0) % world_size for g in groups]


class BalancedAssigner:
    """Group counts per rank differ by at most one; within that, the rank with the fewest
    tokens takes the next largest group (ties to the lowest rank)."""

    def assign(self, groups: Sequence[Sequence[Trajectory]], world_size: int) -> list[int]:
        lo, extra = divmod(len(groups), world_size)
        tokens = [0] * world_size
        count = [0] * world_size
        ranks = [0] * len(groups)
        sizes = [sum(t.num_tokens for t in g) for g in groups]
        for i in sorted(range(len(groups)), key=lambda i: (-sizes[i], i)):
            full = sum(c > lo for c in count)  # ranks that took one of the `extra` groups
            ok = [
                r for r in range(world_size) if count[r] < lo or (count[r] == lo and full < extra)
            ]
            r = min(ok, key=lambda r: tokens[r])
            ranks[i] = r
            tokens[r] += sizes[i]
            count[r] += 1
        return ranks


def make_assigner(name: Literal["balanced", "modulo"]) -> Assigner:
    """The assignment policy named by ``experience.assignment``."""
    if name == "balanced":
        return BalancedAssigner()
    if name == "modulo":
        return ModuloAssigner()
    raise ValueError(f"experience.assignment={name!r}: allowed values: 'balanced', 'modulo'")
