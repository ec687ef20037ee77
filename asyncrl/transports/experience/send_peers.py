"""What a producer keeps per consumer rank: unacked messages, credit, broadcasts, redelivery.

Contract (run by the sending process): a :class:`Peer` holds every message sent to its
rank until the rank acks it (:meth:`Peer.ack`; its ring space freed then), the
broadcasts (Save, Shutdown) the rank may not have received, and the order in which they
are redelivered (``resend``) after the rank restarted (:meth:`Peer.restarted`), said its
first Hello (:meth:`Peer.first_hello`) or reconnected after a cut (:meth:`Peer.resumed`):
always in the order first sent, a broadcast after the batches sent before it. It sends
nothing itself; :class:`~asyncrl.transports.experience.zmq_send.ExperienceSender` does,
as credit allows.
"""

from __future__ import annotations

import collections
from typing import Any

import msgspec

from asyncrl.transports.experience.shm import RingWriter
from asyncrl.transports.experience.wire import TrainBatch

__all__ = ["Ctl", "Peer", "Pending"]


class Pending(msgspec.Struct, gc=False):
    """A message sent and not yet acked: its frames (references, no copy)."""

    frames: list[Any]  # [header] only when the payload is in the ring
    episode_ids: list[int]
    nbytes: int
    in_ring: bool = False


class Ctl(msgspec.Struct, gc=False):
    """A broadcast (Save, Shutdown) kept for redelivery after a cut: the ``index``-th of this
    incarnation, sent after the batches before seq ``position``."""

    index: int
    position: int
    frames: list[bytes]


def _sent_order(x: int | Ctl) -> tuple[int, int]:
    """The order first sent: a broadcast went after the seqs before its position."""
    return (x.position, 0) if isinstance(x, Ctl) else (x, 1)


class Peer:
    """Producer-side state of one consumer rank."""

    def __init__(self) -> None:
        self.ident: bytes | None = None
        self.control: bytes | None = None  # its control connection's identity (notices)
        self.incarnation: int | None = None
        self.alive = False
        self.connected = False  # a route to its data connection (False after EHOSTUNREACH)
        self.max_bytes = 0  # the rank's size limit (its socket cuts a larger frame); 0: ours
        self.credit = 0
        self.last_seen = 0.0
        self.next_seq = 0
        self.pending: dict[int, Pending] = {}  # insertion order == seq order
        self.resend: collections.deque[int | Ctl] = collections.deque()  # seqs, broadcasts
        self.controls: list[Ctl] = []  # broadcasts it may not have received (none acked after)
        self.n_controls = 0  # broadcasts sent to this incarnation
        self.ring: RingWriter | None = None
        self.shm = False  # the current incarnation maps our ring

    def ready(self) -> bool:
        """A new batch may go now: the rank is there, reachable, has credit and nothing
        waits for redelivery before it."""
        return self.alive and self.connected and self.credit > 0 and not self.resend

    def new_control(self, frames: list[bytes]) -> Ctl:
        """Keep a broadcast for this rank, placed after the batches sent so far."""
        ctl = Ctl(self.n_controls, self.next_seq, frames)
        self.n_controls += 1
        self.controls.append(ctl)
        return ctl

    def _drop(self, seq: int) -> Pending:
        item = self.pending.pop(seq)
        if item.in_ring and self.ring is not None:
            self.ring.free(seq)
        return item

    def ack(self, acked: list[int]) -> int:
        """The rank used the messages ``acked`` (unknown seqs ignored), and so every broadcast
        sent before the last of them. Returns how many were pending."""
        n = 0
        for seq in acked:
            if seq in self.pending:
                self._drop(seq)
                n += 1
        if acked and self.controls:  # it had every broadcast sent before those
            last = max(acked)
            self.controls = [c for c in self.controls if c.position > last]
        return n

    def forget(self) -> list[int]:
        """Drop everything unacked and forget the incarnation (the rank restarts from a
        checkpoint: the caller re-sends what it needs). Returns the seqs dropped."""
        seqs = list(self.pending)
        for seq in seqs:
            self._drop(seq)
        self.resend.clear()
        self.controls.clear()
        self.n_controls = 0  # its new incarnation counts the broadcasts it gets from 0
        self.alive, self.ident, self.incarnation, self.credit = False, None, None, 0
        self.control = None
        self.connected = False
        return seqs

    def restarted(self) -> None:
        """A new incarnation: every unacked batch is redelivered; the broadcasts are not (the
        caller re-sends what it needs)."""
        self.resend = collections.deque(self.pending)
        self.controls, self.n_controls = [], 0

    def first_hello(self) -> None:
        """Its first Hello: what was sent or broadcast before it, in order."""
        first: list[int | Ctl] = [*self.pending, *self.controls]
        self.resend = collections.deque(sorted(first, key=_sent_order))

    def resumed(self, last_seq: int, unacked: list[int], controls: int) -> int:
        """The same incarnation reconnected after a cut, having received up to ``last_seq``
        (of which ``unacked`` not acked yet) and ``controls`` broadcasts: the rest of those
        is acked, what follows is redelivered. Returns how many were acked."""
        held = set(unacked)
        done = [s for s in self.pending if s <= last_seq and s not in held]
        for seq in done:
            self._drop(seq)
        lost: list[int | Ctl] = [s for s in self.pending if s > last_seq]
        lost += [c for c in self.controls if c.index >= controls]
        self.resend = collections.deque(sorted(lost, key=_sent_order))
        return len(done)

    def unring(self, seq: int) -> Pending:
        """Pending message ``seq`` as frames (for an incarnation that does not map the ring):
        its payload copied out of the ring, which it leaves."""
        item = self.pending[seq]
        assert self.ring is not None
        batch = msgspec.msgpack.decode(item.frames[0], type=TrainBatch)
        payload = self.ring.read(batch.offset, item.nbytes - len(item.frames[0]))
        self.ring.free(batch.seq)
        header = msgspec.msgpack.encode(msgspec.structs.replace(batch, ring=-1, offset=0))
        self.pending[seq] = Pending([header, payload], item.episode_ids, len(header) + len(payload))
        return self.pending[seq]
