"""Engine side of delta pushes: :class:`DeltaApplier` (see ``delta`` for the encoding).

Each bucket has two receive buffers: the live one (the model serves from it, never written)
and the standby one, which receives the next push. The applier knows which version each
buffer holds and the last delta it applied per bucket. A delta v -> v+1 is applied into the
standby buffer once it holds v; after the commit of v the standby buffer holds v-1, so it is
*caught up*: the last delta (v-1 -> v) re-applied, or the live buffer copied. The receiver
replays the last delta right after each commit, in the background
(:meth:`DeltaApplier.catch_up`), so the next push only applies its own delta; a push that
arrives first stops the catch-up at the next bucket and catches the remaining buckets up
itself, inline, as it applies them.

Which base a delta may have: the version its bucket's last push left here (what a single
sender always sends against: after a failed push or a re-formed group it pushes in full) or,
for a bucket the model serves from (two buffers), the version its other buffer holds. A
bucket whose parameters are copies of its bytes (a tensor split across buckets, joined at
the commit; a converted dtype) has no live buffer: it keeps one, the bytes of its last push.
So of two senders pushing each version in turn (``asyncrl bench weight-sync --delta``), the
delta sender must go first: pushed after the other one's v, its delta against v-1 finds v
there. Any other base is refused (ValueError, the push fails) and the sender's next push
goes in full.

All-or-nothing stays the receiver's: the model switches to the buffers only at the commit.
Thread-safe: every method holds one lock while it reads or writes a buffer's state.
"""

from __future__ import annotations

import threading

import torch

from asyncrl.transports.weights.delta import apply_payload

__all__ = ["DeltaApplier"]


class DeltaApplier:
    """Engine side: the version each receive buffer holds and the last delta per bucket."""

    def __init__(self) -> None:
        self._held: dict[int, int] = {}  # buffer data_ptr -> version it holds
        self._last: dict[int, tuple[int, int, torch.Tensor]] = {}  # bucket -> (from, to, payload)
        self._spare: dict[int, list[torch.Tensor]] = {}  # bucket -> payload receive buffers
        self._lock = threading.RLock()
        self._generation = 0  # moves on when a push starts: an older catch-up stops

    def received(self, buf: torch.Tensor, version: int | None) -> None:
        """``buf`` now holds ``version`` of its bucket (None: undefined, being overwritten;
        waits for a catch-up writing it)."""
        with self._lock:
            if version is None:
                self._held.pop(buf.data_ptr(), None)
            else:
                self._held[buf.data_ptr()] = version

    def apply(
        self,
        index: int,
        dst: torch.Tensor,
        live: torch.Tensor | None,
        payload: torch.Tensor,
        base: int,
        version: int,
    ) -> int:
        """Make ``dst`` (flat uint8) hold ``version`` = ``base`` + ``payload``; ``live`` is the
        bucket's other buffer (serving, never written). Raises ValueError when neither buffer
        can be brought to ``base`` (the sender must push in full)."""
        with self._lock:
            self._bring(index, dst, live, base)
            self._held.pop(dst.data_ptr(), None)
            changed = apply_payload(dst, payload)
            self._held[dst.data_ptr()] = version
            self._last[index] = (base, version, payload)
            return changed

    def _bring(self, index: int, dst: torch.Tensor, live: torch.Tensor | None, base: int) -> None:
        """``dst`` to version ``base``: as it is, the last delta re-applied, or ``live`` copied."""
        held = self._held.get(dst.data_ptr())
        if held == base:
            return
        last = self._last.get(index)
        live_v = None if live is None else self._held.get(live.data_ptr())
        if last is not None and held == last[0] and last[1] == base:
            self._held.pop(dst.data_ptr(), None)
            apply_payload(dst, last[2])
        elif live is not None and live_v == base:
            self._held.pop(dst.data_ptr(), None)
            dst.copy_(live)
        else:
            raise ValueError(
                f"bucket {index}: a delta against v{base}, but this engine holds "
                f"v{live_v if live_v is not None else held} of it (a full push is needed)"
            )
        self._held[dst.data_ptr()] = base

    def generation(self) -> int:
        """The current push's number: what :meth:`catch_up` is given after a commit."""
        return self._generation

    def push_started(self) -> None:
        """A push starts (its bucket 0 arrived): a catch-up still running stops after the
        bucket it is writing (the push catches up the rest itself)."""
        with self._lock:
            self._generation += 1

    def catch_up(self, index: int, dst: torch.Tensor, live: torch.Tensor, generation: int) -> bool:
        """After a commit: bring bucket ``index``'s standby buffer ``dst`` to the version the
        live one holds when the last delta leads there from the version ``dst`` holds (its
        replay; a copy of the live buffer is left to a push that needs it: a sender may still
        send a delta against the version ``dst`` holds, e.g. after another sender's full push
        of a bucket that has two buffers).
        False once a push started after ``generation``: stop, that push's buckets catch up
        themselves."""
        with self._lock:
            if generation != self._generation:
                return False
            last = self._last.get(index)
            held = self._held.get(dst.data_ptr())
            want = self._held.get(live.data_ptr())
            if want is not None and last is not None and (held, want) == last[:2]:
                self._held.pop(dst.data_ptr(), None)
                apply_payload(dst, last[2])
                self._held[dst.data_ptr()] = want
            return True

    def payload_buffer(self, index: int, nbytes: int, bucket_nbytes: int, device: torch.device):
        """Where bucket ``index``'s next delta payload of ``nbytes`` is received: one of two
        buffers kept per bucket (never the last payload's, which a catch-up replays), so its
        pages are mapped once, not on every push; a fresh one when it is large (more than a
        quarter of the bucket: not kept)."""
        if 4 * nbytes > bucket_nbytes:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        with self._lock:
            last = self._last.get(index)
            in_use = None if last is None else last[2].untyped_storage().data_ptr()
            spare = self._spare.setdefault(index, [])
            for buf in spare:
                if buf.untyped_storage().data_ptr() != in_use and buf.numel() >= nbytes:
                    return buf[:nbytes]
            spare[:] = [b for b in spare if b.untyped_storage().data_ptr() == in_use]
            buf = torch.empty(nbytes + nbytes // 4, dtype=torch.uint8, device=device)
            spare.append(buf)
            return buf[:nbytes]

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
            self._last.clear()
            self._spare.clear()
            self._generation += 1
