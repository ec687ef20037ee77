"""Which LoRA adapter version a request names (a LoRA run, ``lora.rank > 0``).

Every engine holds the last ``capacity = controller.max_staleness + 1`` adapter versions
(the embedded engine's ring, or the versions the trainer's adapter sender keeps loaded on
SGLang). The controller names one in every request (``lora_path = "{name}-v{N}"``), so a
request's tokens are made by version N by construction:

- a new request names the newest version the controller announced (``newest``: every
  engine holds it, since a version is announced only once delivered everywhere);
- a continuation (a request resubmitted after an abort or a failed engine, with tokens
  already made) keeps the version of its last token while every engine surely still holds
  it: ``v >= newest - capacity + 2`` (the oldest held version, ``newest - capacity + 1``,
  may be under unloading by the push of ``newest + 1`` already); older, it continues on
  the newest, and its tokens say so (a trajectory may span versions);
- version 0 is the base model (PEFT's fresh adapter has ``B = 0``: its delta is exactly
  zero): a request at version 0 names no adapter.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["AdapterNames"]


class AdapterNames:
    """The adapter version (and name) of each request (module docstring: the rule)."""

    __slots__ = ("capacity", "name", "newest")

    def __init__(self, name: str, capacity: int, newest: int = 0):
        if capacity < 1:
            raise ValueError(f"adapter ring capacity must be >= 1, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.newest = newest

    def version_for(self, versions: Sequence[int]) -> int:
        """The version a request with ``versions`` (its tokens so far) runs on."""
        if versions:
            last = versions[-1]
            if self.newest - self.capacity + 2 <= last <= self.newest:
                return last
        return self.newest

    def path(self, version: int) -> str | None:
        """``{name}-v{version}``; None for version 0 (the base model)."""
        return f"{self.name}-v{version}" if version > 0 else None
