"""Consumer side of the experience channel: one ``ExperienceReceiver`` per trainer rank.

Runs in each trainer rank; the producers' side (and the protocol) is ``zmq_send.py``.
The receiver connects a data DEALER (batches in, credits out; used by the consumer's
own thread) and a control DEALER (heartbeats and notices on a small thread, reports
from any thread) to every producer. On the producer's host it maps the shared-memory
rings producers announce (``shm.py``).

A cut connection is restored, nothing lost: libzmq drops a connection for good when a
peer sends a frame over ``ZMQ_MAXMSGSIZE`` (a protocol error: its session is
terminated, not reconnected; see libzmq's ``zmq_setsockopt`` on ZMQ_MAXMSGSIZE and
``session_base.cpp``), and frames queued on a cut connection are dropped. Each socket
has a monitor (``zmq_socket_monitor``); on ``ZMQ_EVENT_DISCONNECTED`` the receiver
replaces the socket by a new one under a new routing id (so nothing of the old
connection can be taken for the new one at the producer's ROUTER) and says Hello again:
for the data socket a *resume* (``Hello.last_seq`` / ``unacked``, see ``types.Hello``),
after which the producer redelivers what the cut lost, in order. ``reconnects`` counts
these.
"""

from __future__ import annotations

import collections
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import cast

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from asyncrl.core import Trajectory
from asyncrl.transports.experience.codec import (
    MalformedMessage,
    RejectLog,
    decode,
    encode,
    nbytes,
)
from asyncrl.transports.experience.control import Engines, Save, Shutdown
from asyncrl.transports.experience.curve import curve_client, uses_curve
from asyncrl.transports.experience.shm import RingReader, host_token
from asyncrl.transports.experience.wire import Credit, Hello, Message, Ring, TrainBatch

__all__ = ["Delivery", "ExperienceReceiver"]

log = logging.getLogger(__name__)
_DRAIN = 64  # messages taken per readiness event, so a flood cannot starve timeouts
_NOTICE_POLL_S = 0.05  # how often the control thread looks for notices
_SETTLE_S = 0.1  # longest wait for the rest of a cut connection's messages (_take_rest)
_MONITOR_IDS = itertools.count()  # unique inproc addresses of socket monitors


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
        curve: bool = True,
        secret: str | None = None,
    ):
        """``curve``: CURVE to every TCP endpoint, keys from ``secret`` (default: this
        process's run secret), as the producer's :class:`ExperienceSender` expects."""
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
        self._last_seq = [-1] * len(self.endpoints)  # highest seq received, per producer
        self._unacked: list[set[int]] = [set() for _ in self.endpoints]  # received, not acked
        self._controls = [0] * len(self.endpoints)  # broadcasts (Save, Shutdown) received
        self._links = itertools.count()  # numbers the routing ids of this incarnation
        self._cuts = [0, 0]  # data connections restored (this thread), control ones (any)
        self._curve, self._secret = curve, secret
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._index: dict[zmq.Socket, tuple[int, bool]] = {}  # -> (producer, is a monitor)
        self._data: list[zmq.Socket] = []  # and each socket's monitor:
        self._data_mon: list[zmq.Socket] = []
        self._ctl: list[zmq.Socket] = []
        self._ctl_mon: list[zmq.Socket] = []
        for i in range(len(self.endpoints)):
            sock, mon = self._connect(i, control=False)
            self._data.append(sock)
            self._data_mon.append(mon)
            self._watch(i, sock, mon)
            sock, mon = self._connect(i, control=True)
            self._ctl.append(sock)
            self._ctl_mon.append(mon)
        self._ctl_lock = threading.Lock()
        self._stop = threading.Event()
        self._beat = threading.Thread(
            target=self._heartbeat, args=(heartbeat_s,), name=f"xport-hb{rank}", daemon=True
        )
        self._beat.start()

    @property
    def reconnects(self) -> int:
        """Data and control connections restored after a cut (see the module docstring)."""
        return sum(self._cuts)

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
                producer, is_monitor = self._index[sock]
                if is_monitor:
                    if _cut(sock):
                        self._resume(producer)
                else:
                    self._drain(sock, producer)
        return self._ready.popleft()

    def ack(self, delivery: Delivery, flush: bool = False) -> None:
        """The delivery is used: its producer may forget it and send one more. Its arrays
        may be overwritten from now on if they view a shared-memory ring (see the class).

        Acks go out in batches of ``credits // 2``, or before ``recv`` waits once the
        producer's remaining credit is down to half the window; ``flush`` sends at once
        (for consumers that ack rarely, e.g. once per train step)."""
        if isinstance(delivery.msg, TrainBatch):
            self._unacked[delivery.producer].discard(delivery.msg.seq)
            self._acks[delivery.producer].append(delivery.msg.seq)
            if flush or len(self._acks[delivery.producer]) >= self._ack_batch:
                self._send_acks()

    def report(self, msg: Message) -> None:
        """Send a report (StepDone, Shutdown) to every producer; safe from any thread.

        Raises ValueError for a report over the size limit (the producer would cut the
        connection on it: libzmq's MAXMSGSIZE)."""
        frames = encode(msg)
        if nbytes(frames) > self._max_bytes:
            raise ValueError(
                f"report {type(msg).__name__} of {nbytes(frames)} bytes exceeds "
                f"experience.max_message_mb ({self._max_bytes} bytes): send smaller metrics"
            )
        with self._ctl_lock:
            if self._stop.is_set():
                raise RuntimeError(f"report({type(msg).__name__}) after the receiver was closed")
            self._restore_control()
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
            socks = [*self._data, *self._ctl]
            for s, mon in zip(socks, [*self._data_mon, *self._ctl_mon], strict=True):
                _close(s, mon, linger=1000)
        self._ctx.term()
        for ring in [*self._old_rings, *(r for rings in self._rings for r in rings.values())]:
            ring.close()

    def _reap(self) -> None:
        for rings in self._rings:
            for ring in rings.values():
                ring.reap()

    # -- internals -----------------------------------------------------------------------
    def _connect(self, producer: int, control: bool) -> tuple[zmq.Socket, zmq.Socket]:
        """A new DEALER (and its monitor) to ``producer``, a new routing id, Hello sent.

        A data Hello carries what this incarnation received so far (a resume after a cut;
        nothing on the first connection)."""
        s = self._ctx.socket(zmq.DEALER)
        kind = "c" if control else "d"
        link = next(self._links)
        s.setsockopt(zmq.IDENTITY, f"{kind}{self.rank}-{self.incarnation:x}-{link}".encode())
        s.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)
        s.setsockopt(zmq.RCVHWM, 0)  # credits bound what can arrive
        s.setsockopt(zmq.LINGER, 0)
        mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED, f"inproc://xport-{next(_MONITOR_IDS)}")
        if uses_curve(self.endpoints[producer], self._curve):
            curve_client(s, self._secret)
        s.connect(self.endpoints[producer])
        unacked = [] if control else sorted(self._unacked[producer])
        hello = Hello(
            rank=self.rank,
            world_size=self.world_size,
            incarnation=self.incarnation,
            credit=0 if control else self.credits - len(unacked),
            control=control,
            shm="" if control else self._shm,
            last_seq=-1 if control else self._last_seq[producer],
            unacked=unacked,
            max_bytes=self._max_bytes,
            controls=0 if control else self._controls[producer],
        )
        s.send_multipart(encode(hello))
        return s, mon

    def _watch(self, producer: int, sock: zmq.Socket, mon: zmq.Socket) -> None:
        for x, is_monitor in ((sock, False), (mon, True)):
            self._poller.register(x, zmq.POLLIN)
            self._index[x] = (producer, is_monitor)

    def _resume(self, producer: int) -> None:
        """The data connection to ``producer`` was cut: replace the socket, say Hello again.

        What the old socket received before the cut is taken first; held acks go out
        implicitly (the Hello lists only what is still unacked)."""
        old, mon = self._data[producer], self._data_mon[producer]
        self._take_rest(old, producer)
        for x in (old, mon):
            self._poller.unregister(x)
            del self._index[x]
        _close(old, mon, linger=0)
        self._acks[producer] = []
        self._window[producer] = self.credits - len(self._unacked[producer])
        sock, mon = self._connect(producer, control=False)
        self._data[producer], self._data_mon[producer] = sock, mon
        self._watch(producer, sock, mon)
        self._cuts[0] += 1
        log.warning(
            "rank %d: data connection to %s was cut; reconnected (last seq %d, %d unacked)",
            self.rank,
            self.endpoints[producer],
            self._last_seq[producer],
            len(self._unacked[producer]),
        )

    def _take_rest(self, old: zmq.Socket, producer: int) -> None:
        """Take what a cut socket received before its cut. libzmq emits the monitor's
        EVENT_DISCONNECTED just before it flushes the last messages it read to the socket
        and then ends the connection's pipe (``stream_engine_base_t::error``), after which
        the DEALER cannot send (no POLLOUT): drain until then. A connection lost by other
        means (the producer went away) keeps its pipe for a reconnection: then drain for
        ``_SETTLE_S`` at most."""
        deadline = time.monotonic() + _SETTLE_S
        while True:
            events = cast(int, old.getsockopt(zmq.EVENTS))  # an int option
            if events & zmq.POLLIN:
                self._drain(old, producer)
            elif not events & zmq.POLLOUT or time.monotonic() >= deadline:
                return
            else:
                old.poll(5, zmq.POLLIN)

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
                if self._stop.is_set():
                    return
                self._restore_control()
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

    def _restore_control(self) -> None:
        """Replace every cut control connection (a new socket and routing id, a Hello);
        call with ``_ctl_lock`` held."""
        for i in range(len(self._ctl)):
            if _cut(self._ctl_mon[i]):
                _close(self._ctl[i], self._ctl_mon[i], linger=0)
                self._ctl[i], self._ctl_mon[i] = self._connect(i, control=True)
                self._cuts[1] += 1
                log.warning("rank %d: control connection to %s was cut; reconnected",
                            self.rank, self.endpoints[i])  # fmt: skip

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
                    if msg.seq <= self._last_seq[producer]:
                        raise MalformedMessage(
                            "protocol", f"seq {msg.seq} after seq {self._last_seq[producer]}"
                        )
                    if self._window[producer] <= 0:
                        raise MalformedMessage("protocol", f"seq {msg.seq} sent without credit")
                    self._window[producer] -= 1
                    self._last_seq[producer] = msg.seq
                    self._unacked[producer].add(msg.seq)
                elif isinstance(msg, Shutdown | Save | Engines):
                    self._controls[producer] += 1
                else:
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


def _cut(monitor: zmq.Socket) -> bool:
    """Drain a socket's monitor: True if its connection was cut (EVENT_DISCONNECTED)."""
    cut = False
    while True:
        try:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return cut
        cut = cut or event["event"] == zmq.EVENT_DISCONNECTED


def _close(sock: zmq.Socket, monitor: zmq.Socket, linger: int) -> None:
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=linger)


def _send(sock: zmq.Socket, frames: list[bytes]) -> bool:
    """Send without blocking; False when the peer's queue is full (it is gone or stuck)."""
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True
