"""The controller's input: samples submitted or drawn from a source, in admission order.

Contract: :class:`Samples` hands out the next sample to admit (:meth:`Samples.take`: the
queued ones first — re-queued stale groups' samples at the front — then the source's,
drawn lazily), refuses a sample that a checkpoint could not store (``TypeError`` from
:func:`~asyncrl.controllers.state.check_sample`, for a submitted one before any of its
batch is queued), refuses input after :meth:`Samples.end`, and keeps its position (the
queue, the count drawn from the source) for a checkpoint; :meth:`Samples.restore`
continues the same source where a checkpoint left it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

from asyncrl.controllers.state import check_sample, decode_sample, encode_sample

__all__ = ["Samples"]

_END = object()


class Samples:
    """Samples waiting for admission; ``source``: an optional iterable, pulled lazily."""

    def __init__(self, source: Iterable[Any] | None):
        self.queued: deque[Any] = deque()
        self._source: Iterator[Any] | None = iter(source) if source is not None else None
        self.drawn = 0  # samples taken from the source (the data stream's position)
        self.ended = False  # end() was called: no more submissions

    def __len__(self) -> int:
        """The queued samples (the source's are not counted)."""
        return len(self.queued)

    def submit(self, samples: Iterable[Any]) -> None:
        """Queue ``samples`` (see ``Controller.submit``)."""
        if self.ended:
            raise ValueError("submit() after end_input(): the controller takes no more samples")
        batch = list(samples)
        for sample in batch:
            check_sample(sample)
        self.queued.extend(batch)

    def end(self) -> None:
        """No more samples will be submitted (a source still hands out its own)."""
        self.ended = True

    def requeue(self, sample: Any) -> None:
        """``sample`` is admitted next (a stale group's, regenerated)."""
        self.queued.appendleft(sample)

    def take(self) -> tuple[bool, Any]:
        """``(True, sample)``: the next sample to admit; ``(False, None)``: none now."""
        if self.queued:
            return True, self.queued.popleft()
        if self._source is not None:
            try:
                sample = next(self._source)
                self.drawn += 1
                check_sample(sample)
                return True, sample
            except StopIteration:
                self._source = None
        return False, None

    @property
    def used_up(self) -> bool:
        """The input ended, and every sample was taken (the source is exhausted)."""
        return self.ended and not self.queued and self._source is None

    def state(self) -> tuple[list[msgspec.Raw], int]:
        """The queued samples (encoded) and the count drawn from the source."""
        return [encode_sample(x) for x in self.queued], self.drawn

    def restore(self, queued: list[msgspec.Raw], drawn: int, sample_type: Any) -> None:
        """Continue from a checkpoint's position: its ``queued`` samples (decoded as
        ``sample_type``) after those already here, and the source (the same stream from its
        start) past the ``drawn`` samples taken from it."""
        self.queued.extend(decode_sample(r, sample_type) for r in queued)
        if self._source is not None:
            for _ in range(drawn):  # the same stream, continued where it stopped
                if next(self._source, _END) is _END:
                    self._source = None
                    break
        self.drawn = drawn
