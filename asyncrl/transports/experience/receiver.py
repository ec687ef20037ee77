"""Consumer side of the experience channel: one ``ExperienceReceiver`` per trainer rank.

See ``zmq.py`` for the protocol. The receiver connects a data DEALER (batches
in, credits out; used by the consumer's own thread) and a control DEALER
(heartbeats and notices on a small thread, reports from any thread) to every producer.
On the producer's host it maps the shared-memory rings producers announce (``shm.py``).
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence

import msgspec
import zmq

from asyncrl.transports.experience.codec import MalformedMessage, RejectLog, decode, encode
from asyncrl.transports.experience.shm import RingReader, host_token
from asyncrl.transports.experience.types import (
    Credit,
    Engines,
    Hello,
    Message,
    Ring,
    Save,
    Shutdown,
    TrainBatch,
    Trajectory,
)

__all__ = ["Delivery", "ExperienceReceiver"]

log = logging.getLogger(__name__)
_DRAIN = 64  # messages taken per readiness event, so a flood cannot starve timeouts
_NOTICE_POLL_S = 0.05  # how often the control thread looks for notices


class Delivery(msgspec.Struct, gc=False):
    """One received message: ``msg`` (TrainBatch, Save, Shutdown), its trajectories, source."""

    msg: Message
    trajs: list[Trajectory]
    producer: int


class ExperienceReceiver:
    """Consumer side for one trainer rank (blocking API).

    ``recv`` returns deliveries in each producer's order and ``ack`` (after use)
    returns credit to their producer: call both from one thread (the consumer's
    loop). ``report`` sends to every producer over separate control connections
    and may be called from any thread; a small thread heartbeats on those, so a
    rank busy training is not taken for dead.

    Arrays of delivered trajectories are read-only views, either of the received
    frames (valid as long as they are referenced) or, on the producer's host, of
    the producer's shared-memory ring: those stay valid and unchanged until
    ``ack`` is called for their delivery, and may be overwritten at any time
    after that. So ack a delivery only once its arrays are copied or no longer
    used (the trainer acks after its train step built its tensors), or pass
    ``copy=True`` to get arrays of their own. ``shm=False`` never maps rings.

    Notices (:class:`Engines` a producer sent with ``notify``) arrive on the control
    connections and are handed, within ``_NOTICE_POLL_S``, to ``on_notice`` (set it to a
    callable; None drops them) on the receiver's own thread: they reach the consumer's
    process while its thread is busy. The handler must return quickly.
    """

    on_notice: Callable[[Engines], None] | None = None

    def __init__(
        self,
        endpoints: Sequence[str],
        rank: int,
        world_size: int,
        *,
        credits: int = 4,
        max_message_bytes: int = 256 << 20,
        heartbeat_s: float = 1.0,
        shm: bool = True,
        copy: bool = False,
    ):
        if credits <= 0:
            raise ValueError(f"credits must be > 0, got {credits}")
        self.rank, self.world_size, self.credits = rank, world_size, credits
        self.endpoints = list(endpoints)
        self.incarnation = random.getrandbits(62)
        self._max_bytes = max_message_bytes
        self._reject = RejectLog(f"rank {rank}")
        self._ready: collections.deque[Delivery] = collections.deque()
        self._window = [credits] * len(self.endpoints)  # credit each producer holds
        self._acks: list[list[int]] = [[] for _ in self.endpoints]  # acked, not yet sent
        self._shm, self._copy = host_token() if shm else "", copy
        self._rings: list[dict[int, RingReader]] = [{} for _ in self.endpoints]
        self._old_rings: list[RingReader] = []  # replaced ones: closed with the receiver
        self._next_reap = 0.0
        self._ack_batch = max(1, credits // 2)
        self._ctx = zmq.Context()
        self._data = [self._connect(ep, control=False) for ep in self.endpoints]
        self._ctl = [self._connect(ep, control=True) for ep in self.endpoints]
        self._index = {s: i for i, s in enumerate(self._data)}
        self._poller = zmq.Poller()
        for s in self._data:
            self._poller.register(s, zmq.POLLIN)
        self._ctl_lock = threading.Lock()
        self._stop = threading.Event()
        self._beat = threading.Thread(
            target=self._heartbeat, args=(heartbeat_s,), name=f"xport-hb{rank}", daemon=True
        )
        self._beat.start()

    @property
    def rejected(self) -> int:
        """Malformed (or credit-violating) messages received and dropped."""
        return self._reject.total

    @property
    def rejected_by(self) -> dict[str, int]:
        """Rejections by kind (see ``codec.REJECT_KINDS``)."""
        return dict(self._reject.by_kind)

    def recv(self, timeout_s: float) -> Delivery | None:
        """Next delivery (a TrainBatch, a Save or a Shutdown) within ``timeout_s``, else None."""
        deadline = time.monotonic() + timeout_s
        while not self._ready:
            self._send_acks(low_only=True)  # never wait while a producer runs low on credit
            now = time.monotonic()
            left = deadline - now
            if left < 0:
                return None
            if now >= self._next_reap:  # idle: unlink the rings of producers that died
                self._reap()
                self._next_reap = now + 1.0
            for sock, _ in self._poller.poll(max(0, int(left * 1000))):
                self._drain(sock, self._index[sock])
        return self._ready.popleft()

    def ack(self, delivery: Delivery, flush: bool = False) -> None:
        """The delivery is used: its producer may forget it and send one more. Its arrays
        may be overwritten from now on if they view a shared-memory ring (see the class).

        Acks go out in batches of ``credits // 2``, or before ``recv`` waits once the
        producer's remaining credit is down to half the window; ``flush`` sends at once
        (for consumers that ack rarely, e.g. once per train step)."""
        if isinstance(delivery.msg, TrainBatch):
            self._acks[delivery.producer].append(delivery.msg.seq)
            if flush or len(self._acks[delivery.producer]) >= self._ack_batch:
                self._send_acks()

    def report(self, msg: Message) -> None:
        """Send a report (StepDone, Shutdown) to every producer; safe from any thread."""
        frames = encode(msg)
        with self._ctl_lock:
            if self._stop.is_set():
                raise RuntimeError(f"report({type(msg).__name__}) after the receiver was closed")
            for i, s in enumerate(self._ctl):
                if not _send(s, frames):
                    log.error(
                        "report %s not sent to %s: its queue is full (producer unreachable)",
                        msg,
                        self.endpoints[i],
                    )

    def close(self) -> None:
        """Stop heartbeats; close the sockets (sent acks and reports get up to 1 s to flush);
        unmap the rings (unlinking those whose producer is gone)."""
        self._send_acks()
        self._stop.set()
        self._beat.join(5.0)
        with self._ctl_lock:
            for s in [*self._data, *self._ctl]:
                s.close(linger=1000)
        self._ctx.term()
        for ring in [*self._old_rings, *(r for rings in self._rings for r in rings.values())]:
            ring.close()

    def _reap(self) -> None:
        for rings in self._rings:
            for ring in rings.values():
                ring.reap()

    # -- internals -----------------------------------------------------------------------
    def _connect(self, endpoint: str, control: bool) -> zmq.Socket:
        s = self._ctx.socket(zmq.DEALER)
        kind = "c" if control else "d"
        s.setsockopt(zmq.IDENTITY, f"{kind}{self.rank}-{self.incarnation:x}".encode())
        s.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)
        s.setsockopt(zmq.RCVHWM, 0)  # credits bound what can arrive
        s.connect(endpoint)
        hello = Hello(
            rank=self.rank,
            world_size=self.world_size,
            incarnation=self.incarnation,
            credit=0 if control else self.credits,
            control=control,
            shm="" if control else self._shm,
        )
        s.send_multipart(encode(hello))
        return s

    def _send_acks(self, low_only: bool = False) -> None:
        """Send held acks (as new credit); ``low_only``: only to producers whose remaining
        credit is down to half the window, so a consumer that keeps up sends few acks."""
        for i, seqs in enumerate(self._acks):
            if seqs and not (low_only and self._window[i] > self.credits // 2):
                self._window[i] += len(seqs)
                if not _send(self._data[i], encode(Credit(acked=seqs, grant=len(seqs)))):
                    log.warning(
                        "acks %s to %s not sent: producer unreachable", seqs, self.endpoints[i]
                    )
                self._acks[i] = []

    def _heartbeat(self, interval_s: float) -> None:
        """Heartbeat every ``interval_s``; hand notices to ``on_notice`` as they come."""
        beat = encode(Credit())
        due = time.monotonic() + interval_s
        while not self._stop.wait(min(interval_s, _NOTICE_POLL_S)):
            with self._ctl_lock:
                if time.monotonic() >= due:
                    due = time.monotonic() + interval_s
                    for s in self._ctl:
                        _send(s, beat)
                notices = self._take_notices()
            for msg in notices:
                handler = self.on_notice
                if handler is None:
                    continue
                try:
                    handler(msg)
                except (ValueError, RuntimeError) as exc:  # logged; heartbeats go on
                    log.error("rank %d: notice %s not taken: %s", self.rank, msg, exc)

    def _take_notices(self) -> list[Engines]:
        """Notices waiting on the control connections (caller holds ``_ctl_lock``); anything
        else a producer sends there is rejected, logged."""
        out: list[Engines] = []
        for i, s in enumerate(self._ctl):
            for _ in range(_DRAIN):
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    msg, _ = decode(frames, self._max_bytes)
                    if not isinstance(msg, Engines):
                        raise MalformedMessage(
                            "protocol", f"a producer may not notify {type(msg).__name__}"
                        )
                except MalformedMessage as exc:
                    self._reject(exc, self.endpoints[i])
                    continue
                out.append(msg)
        return out

    def _drain(self, sock: zmq.Socket, producer: int) -> None:
        for _ in range(_DRAIN):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg, trajs = decode(frames, self._max_bytes, self._rings[producer], self._copy)
                if isinstance(msg, Ring):
                    self._map(msg, producer)
                    continue
                if isinstance(msg, TrainBatch):
                    if self._window[producer] <= 0:
                        raise MalformedMessage("protocol", f"seq {msg.seq} sent without credit")
                    self._window[producer] -= 1
                elif not isinstance(msg, Shutdown | Save | Engines):
                    raise MalformedMessage(
                        "protocol", f"a producer may not send {type(msg).__name__}"
                    )
            except MalformedMessage as exc:
                self._reject(exc, self.endpoints[producer])
                continue
            self._ready.append(Delivery(msg, trajs, producer))

    def _map(self, msg: Ring, producer: int) -> None:
        """Map a ring the producer announced (MalformedMessage if it is not acceptable)."""
        rings = self._rings[producer]
        old = rings.get(msg.ring)
        if old is not None and (old.name, old.nbytes) == (msg.name, msg.nbytes):
            return
        if not self._shm:
            raise MalformedMessage("shm", f"ring {msg.name!r} announced, but shm is off here")
        try:
            reader = RingReader(msg.name, msg.nbytes)
        except ValueError as exc:  # logged by the reject log; its batches will be rejected
            raise MalformedMessage(
                "shm",
                f"cannot map the announced ring: {exc} (set experience.shm = 'off' if the "
                f"producer is on another host or in another container)",
            ) from None
        if old is not None:
            self._old_rings.append(old)
        rings[msg.ring] = reader
        log.info(
            "rank %d maps experience ring %s of %s", self.rank, msg.name, self.endpoints[producer]
        )


def _send(sock: zmq.Socket, frames: list[bytes]) -> bool:
    """Send without blocking; False when the peer's queue is full (it is gone or stuck)."""
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True
