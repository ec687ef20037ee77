"""Experience channel over ZeroMQ: many producers -> one consumer per trainer rank, by credit.

This module is the producers' side (run by the controller, or an episode worker) and
states the protocol; the consumers' side (each trainer rank) is ``zmq_recv``.

Topology: each producer (the controller, or an episode worker elsewhere) binds
one ROUTER socket (127.0.0.1 unless configured; ``tcp://`` or ``ipc://``). Each
consumer (trainer rank r) connects one DEALER to every producer. Protocol::

    consumer ─ Hello(rank, world, incarnation, credit=W) ─▶ producer
    producer ─ TrainBatch(seq, step, ...) + payload ─────▶ consumer   (only while credit > 0)
    consumer ─ Credit(acked=[seq...], grant=k) ───────────▶ producer   (after processing; heartbeat
                                                                        when empty)
    consumer ─ StepDone / Saved / Synced / Shutdown ──────▶ producer   (reports, any thread)
    producer ─ Save / Shutdown / Engines ─────────────────▶ consumer   (broadcast, in order
                                                                        after the batches sent)
    producer ─ Engines (notice) ──────────────────────────▶ consumer's control connection
                                                                       (notify: at once)

Back-pressure, not loss: a producer sends to rank r only while it holds credit
from r; it keeps every sent message (its frames: references, no copy) until r
acks it. A slow trainer therefore slows ``send`` and bounds memory on both
sides at ``credits`` messages per (producer, rank). If a rank falls silent for
``peer_timeout_s`` its unacked messages are reported (log, counter, a
:class:`ConsumerLost` from ``recv_report``) and stay pending; when the rank says
Hello again (a new incarnation) they are redelivered first, in order. Delivery
is at-least-once: a consumer acks after it has used a message.

Same-host fast path (``shm``): a rank on this host gets its batches' arrays through a
shared-memory ring, only the headers through ZeroMQ (:mod:`.send_ring`).

Hardening: every received message goes through :func:`codec.decode` with the
configured size limit; a malformed one is logged (rate-limited), counted in
``rejected`` / ``rejected_by[kind]`` and dropped, and the socket keeps serving.
libzmq's MAXMSGSIZE additionally cuts the connection of a peer that sends a single
frame over the limit before it is buffered (``counters["disconnects"]`` counts cuts
seen by this ROUTER's monitor). A consumer whose connection is cut reconnects under
a new routing id and says Hello again (a resume, see ``types.Hello``): this producer
redelivers, in order, what the cut lost. A send that finds no route to a rank
(``EHOSTUNREACH``: its connection is gone) keeps the message pending and waits for
that resume; only silence (``peer_timeout_s`` without a heartbeat) reports the rank lost.

Authentication (``curve``, on by default): see :mod:`.send_socket`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq

from asyncrl.config import ExperienceConfig
from asyncrl.core import Trajectory
from asyncrl.transports.experience.assign import Assigner, make_assigner
from asyncrl.transports.experience.codec import MalformedMessage, RejectLog, decode, encode
from asyncrl.transports.experience.control import (
    ConsumerLost,
    EnginesSynced,
    Saved,
    Shutdown,
    StepDone,
    Synced,
)
from asyncrl.transports.experience.send_peers import Ctl, Peer, Pending
from asyncrl.transports.experience.send_ring import encode_for, ring_for, shm_token
from asyncrl.transports.experience.send_socket import RouterSocket
from asyncrl.transports.experience.shm import sweep_orphans
from asyncrl.transports.experience.wire import Credit, Hello, Message

__all__ = ["ExperienceSender", "bind_endpoint", "shm_token"]

log = logging.getLogger(__name__)


def bind_endpoint(
    cfg: ExperienceConfig, run_dir: Path | None = None, host: str | None = None
) -> str:
    """The endpoint a producer binds: ``cfg.endpoint``, else tcp on ``host`` (default
    ``cfg.host``; a launcher passes the node's address on a cluster) at any port, or an ipc
    socket in ``run_dir``."""
    if cfg.endpoint:
        return cfg.endpoint
    if cfg.transport == "ipc":
        if run_dir is None:
            raise ValueError("experience.transport='ipc' needs a run folder for the socket file")
        return f"ipc://{Path(run_dir).resolve() / 'experience.ipc'}"
    return f"tcp://{host or cfg.host}:*"


class ExperienceSender:
    """Producer side (asyncio): binds a ROUTER; trainer ranks connect and pull by credit.

    Create inside a running event loop; ``await close()`` when done. ``endpoint``
    is the bound address (with the real port) to give to the consumers. ``shm``
    (``auto``/``on``/``off``, see :func:`shm_token`) and ``shm_bytes`` (per rank) set the
    shared-memory rings; ``uses_shm`` says whether consumers on this host get them.
    """

    def __init__(
        self,
        world_size: int,
        endpoint: str = "tcp://127.0.0.1:*",
        *,
        max_message_bytes: int = 256 << 20,
        peer_timeout_s: float = 30.0,
        assigner: Assigner | None = None,
        shm: str = "auto",
        shm_bytes: int = 64 << 20,
        curve: bool = True,
        secret: str | None = None,
    ):
        """``curve``: CURVE on a TCP endpoint, keys from ``secret`` (default: this process's
        run secret); False only to measure what it costs (``asyncrl bench transport``)."""
        self.world_size = world_size
        self._max_bytes = max_message_bytes
        self._timeout = peer_timeout_s
        self._assigner = assigner or make_assigner("balanced")
        self._token = shm_token(shm)  # first: it may raise
        self.uses_shm = bool(self._token)
        self.counters = collections.Counter(
            {"sent": 0, "sent_shm": 0, "ring_full": 0, "acked": 0, "redelivered": 0}
        )
        self.counters.update(lost_reported=0, resumed=0, unreachable=0, disconnects=0, refused=0)
        self._socket = RouterSocket(endpoint, max_message_bytes, curve, secret, self.counters)
        self.curve = self._socket.curve
        self.endpoint: str = self._socket.endpoint
        self._shm_bytes = shm_bytes
        if self.uses_shm:
            sweep_orphans()  # rings left behind by producers that died
        self._peers = [Peer() for _ in range(world_size)]
        self._by_ident: dict[bytes, tuple[int, int]] = {}  # -> (rank, incarnation)
        self._reports: asyncio.Queue[Message | None] = asyncio.Queue()  # None: failed
        self._changed = asyncio.Event()
        self._error: BaseException | None = None
        self._reject = RejectLog("sender")
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._recv_loop(), name="xport-recv"),
            loop.create_task(self._liveness_loop(), name="xport-live"),
        ]
        for t in self._tasks:
            t.add_done_callback(self._supervise)

    # -- public API ----------------------------------------------------------------------
    @property
    def rejected(self) -> int:
        """Malformed messages received and dropped."""
        return self._reject.total

    def pending(self, rank: int) -> int:
        """Messages sent to ``rank`` (or waiting for redelivery) and not yet acknowledged."""
        return len(self._peers[rank].pending)

    def pending_bytes(self) -> int:
        """Payload bytes held for possible redelivery, over all ranks."""
        return sum(p.nbytes for peer in self._peers for p in peer.pending.values())

    async def send(self, trajs: Sequence[Trajectory], rank: int, step: int = -1) -> int:
        """Send whole groups ``trajs`` to ``rank``; waits (never drops) until ``rank`` has
        credit. Returns the message's seq. Raises ValueError for a message over the limit."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
        peer = self._peers[rank]
        while not peer.ready():
            self._raise_if_failed()
            self._changed.clear()
            await self._changed.wait()
        self._raise_if_failed()
        seq = peer.next_seq
        frames, total, in_ring = encode_for(
            peer, rank, seq, step, trajs, self._max_bytes, self.counters
        )
        peer.next_seq += 1
        eids = [t.episode_id for t in trajs]
        peer.pending[seq] = Pending(frames, eids, total, in_ring)
        peer.credit -= 1
        await self._transmit(rank, frames)
        self.counters["sent"] += 1
        return seq

    async def send_groups(
        self, groups: Sequence[Sequence[Trajectory]], step: int = -1
    ) -> list[int]:
        """Assign whole groups to ranks (the policy) and send one message per rank.

        With ``step >= 0`` every rank gets a message (possibly empty), so all data-parallel
        ranks take part in the step. Returns the rank of each group.
        """
        ranks = self._assigner.assign(groups, self.world_size)
        for r in range(self.world_size):
            shard = [t for g, gr in zip(groups, ranks, strict=True) if gr == r for t in g]
            if shard or step >= 0:
                await self.send(shard, rank=r, step=step)
        return ranks

    async def recv_report(self) -> Message:
        """Next report: StepDone / Shutdown from a consumer, or a local ConsumerLost.

        Raises RuntimeError if the sender's background loop failed."""
        self._raise_if_failed()
        msg = await self._reports.get()
        if msg is None:
            self._raise_if_failed()
        assert msg is not None
        return msg

    def notify(self, msg: Message) -> int:
        """Send ``msg`` (an :class:`Engines` notice) at once over every rank's control
        connection, not queued behind the batches: the receiver hands it to its notice
        handler (``ExperienceReceiver.on_notice``) from its own thread, also while the
        rank is busy training. Best effort: a rank not connected (or gone) misses it, so
        whatever must arrive is also sent in order with :meth:`broadcast`. Returns how many
        ranks it was handed to."""
        frames = encode(msg)
        sent = 0
        for rank, peer in enumerate(self._peers):
            if peer.control is None:
                continue
            try:
                self._socket.send_now(peer.control, frames)
                sent += 1
            except zmq.ZMQError as exc:  # EHOSTUNREACH: that connection is gone
                log.warning("notice %s not sent to rank %d: %s", type(msg).__name__, rank, exc)
        self._socket.poke()
        return sent

    async def broadcast(self, msg: Message) -> int:
        """Send a control message (Save, Shutdown) to every rank, in order after the batches
        sent to it. Kept until a later batch is acked: a cut connection gets it again (see
        ``types.Hello.controls``); a rank that has not said its first Hello yet gets it
        right after that Hello, in order with the batches queued for it. Returns how many
        ranks it was handed to: those with a connection up (sent now, or queued on it behind
        the redeliveries before it); a rank whose connection is cut, or that has not said
        Hello yet, gets it later but is not counted."""
        frames = encode(msg)
        sent = 0
        for rank, peer in enumerate(self._peers):
            ctl = peer.new_control(frames)
            if peer.ident is None:  # delivered by its first Hello (``_hello``)
                continue
            if peer.resend:  # after the redeliveries queued before it
                peer.resend.append(ctl)
            elif peer.connected:
                try:
                    await self._transmit(rank, frames)
                except zmq.ZMQError as exc:
                    log.warning("could not send %s to rank %d: %s", type(msg).__name__, rank, exc)
                    continue
            sent += peer.connected  # False: no route (EHOSTUNREACH), kept for its resume
        return sent

    def forget(self, rank: int) -> list[int]:
        """Rank ``rank`` is being restarted from a checkpoint: drop what it had not acked (the
        caller re-sends what the restored state needs) and send nothing to it until its new
        incarnation says Hello. Returns the seqs dropped."""
        seqs = self._peers[rank].forget()
        self._changed.set()
        return seqs

    async def wait_peers(self, timeout_s: float) -> None:
        """Wait until every rank has said Hello (TimeoutError naming the missing ranks)."""
        deadline = time.monotonic() + timeout_s
        while missing := [r for r, p in enumerate(self._peers) if not p.alive]:
            self._raise_if_failed()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"trainer rank(s) {missing} did not connect in {timeout_s}s")
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    async def close(self) -> None:
        """Stop the loops and close the socket; unacked messages are logged as not delivered."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for rank, peer in enumerate(self._peers):
            if peer.pending:
                log.warning(
                    "closing with %d message(s) to rank %d unacknowledged (seqs %s)",
                    len(peer.pending),
                    rank,
                    list(peer.pending)[:20],
                )
        self._socket.close()
        for peer in self._peers:
            if peer.ring is not None:
                peer.ring.close()
        if self.endpoint.startswith("ipc://"):
            Path(self.endpoint.removeprefix("ipc://")).unlink(missing_ok=True)

    # -- internals -----------------------------------------------------------------------
    def _supervise(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()
            log.error("experience sender task %s failed: %r", task.get_name(), self._error)
            self._reports.put_nowait(None)
            self._socket.stop_reading()  # nobody reads the socket any more
        self._changed.set()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"experience sender failed: {self._error!r}") from self._error

    async def _transmit(self, rank: int, frames: list[Any]) -> None:
        peer = self._peers[rank]
        assert peer.ident is not None  # only a peer that said hello is sent to
        if await self._socket.transmit(peer.ident, frames):
            return
        if peer.connected:  # pending messages wait for its resume (or its silence)
            log.warning("trainer rank %d: no route to its data connection; waiting "
                        "for it to reconnect", rank)  # fmt: skip
            self.counters["unreachable"] += 1
        peer.connected = False

    async def _recv_loop(self) -> None:
        n = 0
        while True:
            parts = await self._socket.recv_next()
            n += 1
            if n % 64 == 0:
                await asyncio.sleep(0)  # a flood of input must not starve the other tasks
            ident = parts[0].bytes
            try:
                msg, _ = decode(parts[1:], self._max_bytes)
                await self._handle(ident, msg)
            except MalformedMessage as exc:
                self._reject(exc, repr(ident))
            self._changed.set()

    async def _handle(self, ident: bytes, msg: Message) -> None:
        if isinstance(msg, Hello):
            await self._hello(ident, msg)
            return
        known = self._by_ident.get(ident)
        if known is None:
            raise MalformedMessage("protocol", f"{type(msg).__name__} before Hello")
        rank, incarnation = known
        peer = self._peers[rank]
        if incarnation == peer.incarnation:
            peer.last_seen = time.monotonic()
            if not peer.alive:  # back from a long silence
                log.warning("trainer rank %d is talking again", rank)
                peer.alive = True
        if isinstance(msg, Credit):
            if ident != peer.ident:
                return  # credit of a dead incarnation: its messages are pending for redelivery
            self.counters["acked"] += peer.ack(msg.acked)
            peer.credit += max(0, msg.grant)
            await self._pump(rank)
        elif isinstance(msg, StepDone | Saved | Synced | Shutdown | EnginesSynced):
            self._reports.put_nowait(msg)
        else:
            raise MalformedMessage("protocol", f"a consumer may not send {type(msg).__name__}")

    async def _hello(self, ident: bytes, msg: Hello) -> None:
        if msg.world_size != self.world_size or not 0 <= msg.rank < self.world_size:
            why = f"hello rank {msg.rank}/{msg.world_size}, expected world {self.world_size}"
            raise MalformedMessage("protocol", why)
        peer = self._peers[msg.rank]
        resume = peer.ident is not None and msg.incarnation == peer.incarnation
        if not msg.control and (msg.credit < 0 or (msg.credit == 0 and not resume)):
            raise MalformedMessage("protocol", f"data hello with credit {msg.credit}")
        self._by_ident[ident] = (msg.rank, msg.incarnation)
        if msg.control:
            peer.control = ident  # the newest connection's: notices go there
            return
        if peer.ident == ident:
            return
        if peer.ident is not None:
            self._by_ident.pop(peer.ident, None)
        if resume:
            self._resume(msg.rank, msg)
        else:
            if peer.ident is not None:
                log.warning("trainer rank %d restarted; redelivering %d unacked message(s)",
                            msg.rank, len(peer.pending))  # fmt: skip
                peer.restarted()  # the caller re-sends the broadcasts it needs
            else:  # its first Hello: what was broadcast before it, in order with the batches
                peer.first_hello()
            # a producer that restarted continues the seqs this incarnation has seen
            peer.next_seq = max(peer.next_seq, msg.last_seq + 1)
        self.counters["redelivered"] += len(peer.resend)
        peer.ident, peer.incarnation, peer.credit = ident, msg.incarnation, msg.credit
        peer.alive, peer.connected, peer.last_seen = True, True, time.monotonic()
        peer.max_bytes = max(0, msg.max_bytes)
        peer.shm = self.uses_shm and msg.shm == self._token
        if peer.shm:  # the ring before any batch that uses it
            await self._transmit(msg.rank, encode(ring_for(peer, msg.rank, self._shm_bytes)))
        await self._pump(msg.rank)

    def _resume(self, rank: int, msg: Hello) -> None:
        """Rank ``rank`` (same incarnation) reconnected after a cut: what it received up to
        ``msg.last_seq`` and does not list as unacked is acked; what follows is redelivered."""
        peer = self._peers[rank]
        self.counters["acked"] += peer.resumed(msg.last_seq, msg.unacked, msg.controls)
        self.counters["resumed"] += 1
        log.warning("trainer rank %d reconnected after a cut; redelivering %d message(s) "
                    "after seq %d", rank, len(peer.resend), msg.last_seq)  # fmt: skip

    async def _pump(self, rank: int) -> None:
        """Redeliver pending messages to a new incarnation, as far as its credit allows."""
        peer = self._peers[rank]
        while peer.resend and peer.alive and peer.connected:
            head = peer.resend[0]
            if isinstance(head, Ctl):  # a broadcast takes no credit
                peer.resend.popleft()
                await self._transmit(rank, head.frames)
                continue
            if peer.credit <= 0:
                break
            seq = peer.resend.popleft()
            assert isinstance(seq, int)
            item = peer.pending.get(seq)
            if item is None:
                continue
            if item.in_ring and not peer.shm:  # this incarnation does not map the ring
                item = peer.unring(seq)
            peer.credit -= 1
            await self._transmit(rank, item.frames)

    def _lose(self, rank: int, why: str) -> None:
        peer = self._peers[rank]
        if not peer.alive:
            return
        peer.alive = False
        seqs = list(peer.pending)
        eids = [e for s in seqs for e in peer.pending[s].episode_ids]
        self.counters["lost_reported"] += len(seqs)
        log.error("trainer rank %d lost (%s): %d unacknowledged message(s), seqs %s, "
                  "episodes %s; kept for redelivery", rank, why, len(seqs), seqs[:20],
                  eids[:50])  # fmt: skip
        self._reports.put_nowait(ConsumerLost(rank=rank, seqs=seqs, episode_ids=eids))

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self._timeout / 4))
            self._socket.count_events()  # in case an edge of the monitor's FD went unseen
            now = time.monotonic()
            for rank, peer in enumerate(self._peers):
                if peer.alive and now - peer.last_seen > self._timeout:
                    self._lose(rank, f"silent for {now - peer.last_seen:.1f}s")
                    self._changed.set()
