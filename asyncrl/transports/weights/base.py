"""The WeightTransport seam: how trainer weights reach the rollout engines.

Contract (sender, trainer rank 0):

- ``connect(engine_urls=None)`` forms the transport with every engine (for
  collectives: a dedicated process group of trainer rank 0 + every engine rank;
  the trainer's default group is never touched). Called again, with or without
  a new list of engines, it tears the old group down and forms a new one: this
  is how a restarted or added engine joins; the next push brings it the
  current weights (every push carries the full weights).
- ``engines_changed(engine_urls, epoch)`` (any thread, returns at once): the run's
  engine set is now ``engine_urls`` (its ``epoch``-th change; older epochs are
  ignored). The next push, or ``connect()``, forms the group with exactly these
  engines, so no push waits on an engine that left the run. A re-form under way that
  waits on an engine not in the set starts again with the set; a push under way that
  involves one fails at once with :class:`EnginesLeft` naming it (tried once more with
  the engines left when nothing of it was sent yet).
- ``push(named_weights, version)`` consumes the iterable in the caller's thread
  (so collectives inside it, e.g. FSDP all-gathers, run on every rank) and
  returns a :class:`PushHandle` at once. A background sender packs the tensors
  bucket by bucket and streams them. The caller must not modify the pushed
  tensors until ``handle.wait_snapshot()`` returns (the trainer calls it just
  before its next optimizer step; with ``snapshot=True`` it has returned
  already). Pushes are delivered in order; a push starts once the previous one
  finished.
- ``handle.wait()`` returns when every engine holds, verified and switched to
  ``version``, or raises :class:`WeightSyncError` naming the engine and its
  error; then every engine kept its previous weights and version. Engines
  always resume generating, also after a failed push; the next push re-forms
  a broken group. Exception: engines that load buckets as they arrive (SGLang)
  cannot keep their previous weights; a push to them that fails on every
  re-push raises :class:`WeightsUndefined` and leaves them paused. That error
  is fatal to the run: no later push or restart can be trusted to repair it.
- ``close()`` waits for the push in flight and tears the group down.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

__all__ = [
    "EnginesLeft",
    "PushHandle",
    "WeightSyncError",
    "WeightTransport",
    "WeightsUndefined",
    "WeightsUnverified",
]


class WeightSyncError(RuntimeError):
    """A push did not reach every engine; the engines kept their previous version."""


class EnginesLeft(WeightSyncError):
    """A push or re-form stopped waiting on engines that are no longer in the run's engine
    set (``engines_changed``); ``urls`` names them."""

    def __init__(self, urls: Sequence[str], now: Sequence[str]):
        self.urls = list(urls)
        super().__init__(
            f"engine(s) {', '.join(self.urls)} left the run's engine set (now: "
            f"{', '.join(now)}): not waiting on them (the others kept their weights)"
        )


class WeightsUndefined(WeightSyncError):
    """A push failed part-way on engines without staging (SGLang) and every re-push failed
    too: their weights are a mix of versions and they are left paused. Fatal to the run
    (restarting the trainer would only push into the same engines again); the message
    names the engines."""


class WeightsUnverified(WeightsUndefined):
    """``weights.verify`` was asked for, and the engines' digests cannot be compared with the
    pushed tensors (the engine family cannot compute what they hold): fatal at once, not
    re-sent (a re-push could not be checked either); the message says why."""


class PushHandle:
    """One push: ``wait_snapshot()`` before touching the weights, ``wait()`` for delivery."""

    def __init__(self, version: int, future: Future[dict[str, float]], snapshot: threading.Event):
        self.version = version
        self._future = future
        self._snapshot = snapshot

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[PushHandle], None]) -> None:
        """Call ``fn(handle)`` once delivered or failed (from the sender's thread)."""
        self._future.add_done_callback(lambda _: fn(self))

    def wait_snapshot(self, timeout: float | None = None) -> float:
        """Block until the sender read every pushed tensor; returns the seconds waited."""
        t0 = time.perf_counter()
        while not self._snapshot.wait(0.05 if timeout is None else timeout):
            if self._future.done():  # failed before it finished reading
                break
            if timeout is not None:
                raise TimeoutError(f"weight push v{self.version}: snapshot not taken in {timeout}s")
        return time.perf_counter() - t0

    def wait(self, timeout: float | None = None) -> dict[str, float]:
        """Block until delivered; returns timing stats; raises WeightSyncError on failure."""
        try:
            return self._future.result(timeout)
        except WeightSyncError:
            raise
        except TimeoutError:
            raise
        except Exception as exc:  # the background sender's failure, re-raised typed
            raise WeightSyncError(f"weight push v{self.version} failed: {exc}") from exc


class WeightTransport(Protocol):
    """Sending side of weight sync (see module docstring for the contract)."""

    def connect(self, engine_urls: Sequence[str] | None = None) -> None:
        """Form (or re-form, with these engines) the transport with every engine."""
        ...

    def engines_changed(self, engine_urls: Sequence[str], epoch: int) -> None:
        """The run's engine set changed (see module docstring); any thread, returns at once."""
        ...

    def push(self, named_weights: Iterable[tuple[str, torch.Tensor]], version: int) -> PushHandle:
        """Start streaming ``named_weights`` as ``version``; returns at once."""
        ...

    def close(self) -> None:
        """Wait for the push in flight, tear the group down, stop the sender thread."""
        ...
