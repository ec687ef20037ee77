"""The WeightTransport seam: how trainer weights reach the rollout engines.

Contract (sender, trainer rank 0):

- ``connect()`` forms the transport with every engine (for collectives: a
  dedicated process group of trainer rank 0 + every engine rank; the trainer's
  default group is never touched).
- ``push(named_weights, version)`` snapshots the weights into staging buffers
  and returns a :class:`PushHandle` at once; a background sender streams the
  buckets. The caller may change its parameters as soon as ``push`` returns.
  Pushes are delivered in order; a push waits for the previous one to leave
  the staging buffers.
- ``handle.wait()`` returns when every engine holds and acknowledged
  ``version``, or raises :class:`WeightSyncError`; engines always resume
  generating, also after a failed push.
- ``close()`` tears the group down.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["PushHandle", "WeightSyncError", "WeightTransport"]


class WeightSyncError(RuntimeError):
    """A push did not reach every engine; the engines kept their previous version."""


class PushHandle:
    """Delivery of one push: ``wait()`` for it; ``stats`` once done (seconds, bytes)."""

    def __init__(self, version: int, future: Future[dict[str, float]]):
        self.version = version
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[PushHandle], None]) -> None:
        """Call ``fn(handle)`` once delivered or failed (from the sender's thread)."""
        self._future.add_done_callback(lambda _: fn(self))

    def wait(self, timeout: float | None = None) -> dict[str, float]:
        """Block until delivered; returns timing stats; raises WeightSyncError on failure."""
        try:
            return self._future.result(timeout)
        except WeightSyncError:
            raise
        except Exception as exc:  # the background sender's failure, re-raised typed
            raise WeightSyncError(f"weight push v{self.version} failed: {exc}") from exc


class WeightTransport(Protocol):
    """Sending side of weight sync (see module docstring for the contract)."""

    def connect(self) -> None: ...

    def push(
        self, named_weights: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> PushHandle: ...

    def close(self) -> None: ...
