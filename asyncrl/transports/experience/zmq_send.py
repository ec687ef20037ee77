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

Same-host fast path (``shm``): the producer creates one shared-memory ring per rank
whose consumer shares its ``/dev/shm`` (``Hello.shm`` carries the consumer's
:func:`~asyncrl.transports.experience.shm.host_token`; equal tokens mean same boot,
same tmpfs, same user: one host, whatever the endpoint), announces it (a
:class:`Ring` message) and writes each batch's arrays into it (one copy); only the
header goes through ZeroMQ. Ring space of a message is freed when it
is acked, so credits bound ring use as they bound frames; a message that finds no room
(or an empty one) goes as frames. Unacked messages stay in the ring: a restarted
consumer is told the ring again and maps it, and redelivery resends just the headers.

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

Authentication (``curve``, on by default): on a TCP endpoint the ROUTER is a ZeroMQ CURVE
server whose keys derive from the run secret (:mod:`.curve`); only consumers holding the
secret complete the handshake, and everything on the wire is encrypted. Refused handshakes
are counted in ``counters["refused"]`` (the monitor's HANDSHAKE_FAILED events) and change
nothing else.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from asyncrl.config import ExperienceConfig
from asyncrl.core import Trajectory
from asyncrl.transports.experience.assign import Assigner, make_assigner
from asyncrl.transports.experience.codec import (
    MalformedMessage,
    RejectLog,
    decode,
    encode,
    encode_batch,
    encode_header,
    header_limits,
    payload_size,
)
from asyncrl.transports.experience.control import (
    ConsumerLost,
    EnginesSynced,
    Saved,
    Shutdown,
    StepDone,
    Synced,
)
from asyncrl.transports.experience.curve import REFUSED_EVENTS, Zap, curve_server, uses_curve
from asyncrl.transports.experience.shm import RingWriter, host_token, sweep_orphans
from asyncrl.transports.experience.wire import Credit, Hello, Message, Ring, TrainBatch

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


def shm_token(mode: str) -> str:
    """The host token a producer offers rings to (``experience.shm``); empty: no rings.

    ``auto``: rings for every consumer that shares this host's ``/dev/shm`` (frames for the
    others, e.g. over tcp from another host); ``on``: the same, but a ValueError where this
    host cannot have rings; ``off``: frames only."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"experience.shm must be 'auto', 'on' or 'off', got {mode!r}")
    token = host_token() if mode != "off" else ""
    if mode == "on" and not token:
        raise ValueError("experience.shm='on' needs Linux with /dev/shm: use 'auto' or 'off'")
    return token


class _Pending(msgspec.Struct, gc=False):
    frames: list[Any]  # [header] only when the payload is in the ring
    episode_ids: list[int]
    nbytes: int
    in_ring: bool = False


class _Ctl(msgspec.Struct, gc=False):
    """A broadcast (Save, Shutdown) kept for redelivery after a cut: the ``index``-th of this
    incarnation, sent after the batches before seq ``position``."""

    index: int
    position: int
    frames: list[bytes]


class _Peer:
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
        self.pending: dict[int, _Pending] = {}  # insertion order == seq order
        self.resend: collections.deque[int | _Ctl] = collections.deque()  # seqs, broadcasts
        self.controls: list[_Ctl] = []  # broadcasts it may not have received (none acked after)
        self.n_controls = 0  # broadcasts sent to this incarnation
        self.ring: RingWriter | None = None
        self.shm = False  # the current incarnation maps our ring


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
        # A plain (blocking-API) socket driven by the event loop: sends never block (SNDHWM 0,
        # credits bound the queue), so they skip zmq.asyncio's per-call future machinery
        # (about 8 us per message); the loop watches the socket's FD for incoming messages.
        self._token = shm_token(shm)  # first: it may raise
        self.uses_shm = bool(self._token)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # credits bound what is queued
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._zap: Zap | None = None
        self.curve = uses_curve(endpoint, curve)
        if self.curve:
            self._zap = Zap(self._ctx, secret)  # bound before any peer can connect
            curve_server(self._sock, secret)
        self._sock.bind(endpoint)
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._shm_bytes = shm_bytes
        if self.uses_shm:
            sweep_orphans()  # rings left behind by producers that died
        self._peers = [_Peer() for _ in range(world_size)]
        self._by_ident: dict[bytes, tuple[int, int]] = {}  # -> (rank, incarnation)
        self._reports: asyncio.Queue[Message | None] = asyncio.Queue()  # None: failed
        self._changed = asyncio.Event()
        self._error: BaseException | None = None
        self._reject = RejectLog("sender")
        self._readable = asyncio.Event()  # the socket's FD fired: messages may be waiting
        self._fd = cast(int, self._sock.getsockopt(zmq.FD))  # an int option
        asyncio.get_running_loop().add_reader(self._fd, self._readable.set)
        self._mon = self._sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | REFUSED_EVENTS, f"inproc://xport-router-{id(self):x}"
        )
        self._mon_fd = cast(int, self._mon.getsockopt(zmq.FD))  # an int option
        asyncio.get_running_loop().add_reader(self._mon_fd, self._count_disconnects)
        self._count_disconnects()  # reading arms ZeroMQ's edge-triggered FD
        self.counters = collections.Counter(
            {"sent": 0, "sent_shm": 0, "ring_full": 0, "acked": 0, "redelivered": 0}
        )
        self.counters.update(lost_reported=0, resumed=0, unreachable=0, disconnects=0, refused=0)
        self._tasks = [
            asyncio.get_running_loop().create_task(self._recv_loop(), name="xport-recv"),
            asyncio.get_running_loop().create_task(self._liveness_loop(), name="xport-live"),
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
        while not (peer.alive and peer.connected and peer.credit > 0 and not peer.resend):
            self._raise_if_failed()
            self._changed.clear()
            await self._changed.wait()
        self._raise_if_failed()
        seq = peer.next_seq
        size = payload_size(trajs)
        limit = min(self._max_bytes, peer.max_bytes or self._max_bytes)
        self._check_size(size, len(trajs), 0, limit, rank)
        offset = None
        if peer.shm and size > 0:
            assert peer.ring is not None
            offset = peer.ring.write(seq, trajs, size)
            self.counters["ring_full"] += offset is None
        if offset is None:
            frames = encode_batch(seq, step, trajs)
        else:
            frames = [encode_header(seq, step, trajs, ring=rank, offset=offset)]
            self.counters["sent_shm"] += 1
        total = size + len(frames[0])
        try:
            self._check_size(total, len(trajs), len(frames[0]), limit, rank)
        except ValueError:
            if offset is not None:
                assert peer.ring is not None
                peer.ring.free(seq)
            raise
        peer.next_seq += 1
        eids = [t.episode_id for t in trajs]
        peer.pending[seq] = _Pending(frames, eids, total, offset is not None)
        peer.credit -= 1
        await self._transmit(rank, frames)
        self.counters["sent"] += 1
        return seq

    def _check_size(self, size: int, n_trajs: int, header: int, limit: int, rank: int) -> None:
        """ValueError for a message ``rank`` would reject: over the size limit (the smaller
        of ours and the rank's, whose socket would cut the connection on it), or with more
        trajectories or header bytes than :func:`codec.header_limits` allows."""
        head_cap, traj_cap = header_limits(limit)
        if size > limit:
            raise ValueError(
                f"experience message of {size} bytes exceeds experience.max_message_mb "
                f"({limit >> 20} MiB, the smaller of the producer's and rank {rank}'s): "
                f"raise it or send fewer groups per message"
            )
        if n_trajs > traj_cap or header > head_cap:
            raise ValueError(
                f"experience message of {n_trajs} trajectories with a header of {header} "
                f"bytes exceeds what experience.max_message_mb ({limit >> 20} MiB) allows: "
                f"at most {traj_cap} trajectories and {head_cap} header bytes "
                f"(rewards/timings/metadata); send fewer groups per message or raise it"
            )

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
                self._sock.send_multipart([peer.control, *frames], zmq.NOBLOCK)
                sent += 1
            except zmq.ZMQError as exc:  # EHOSTUNREACH: that connection is gone
                log.warning("notice %s not sent to rank %d: %s", type(msg).__name__, rank, exc)
        if cast(int, self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # see _transmit
            self._readable.set()
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
            ctl = _Ctl(peer.n_controls, peer.next_seq, frames)
            peer.n_controls += 1
            peer.controls.append(ctl)
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
        peer = self._peers[rank]
        seqs = list(peer.pending)
        for seq, item in peer.pending.items():
            if item.in_ring and peer.ring is not None:
                peer.ring.free(seq)
        peer.pending.clear()
        peer.resend.clear()
        peer.controls.clear()
        peer.n_controls = 0  # its new incarnation counts the broadcasts it gets from 0
        peer.alive, peer.ident, peer.incarnation, peer.credit = False, None, None, 0
        peer.control = None
        peer.connected = False
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
        asyncio.get_running_loop().remove_reader(self._fd)
        asyncio.get_running_loop().remove_reader(self._mon_fd)
        self._sock.disable_monitor()
        self._mon.close(linger=0)
        for rank, peer in enumerate(self._peers):
            if peer.pending:
                log.warning(
                    "closing with %d message(s) to rank %d unacknowledged (seqs %s)",
                    len(peer.pending),
                    rank,
                    list(peer.pending)[:20],
                )
        self._sock.close(linger=0)
        if self._zap is not None:
            self._zap.close()
        self._ctx.term()
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
            # nobody reads the socket any more: stop watching its FD (it may stay readable)
            asyncio.get_running_loop().remove_reader(self._fd)
        self._changed.set()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"experience sender failed: {self._error!r}") from self._error

    async def _transmit(self, rank: int, frames: list[Any]) -> None:
        peer = self._peers[rank]
        assert peer.ident is not None  # only a peer that said hello is sent to
        while True:
            try:
                self._sock.send_multipart([peer.ident, *frames], zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:  # not expected with SNDHWM 0; wait rather than drop
                await asyncio.sleep(0.001)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                if peer.connected:  # pending messages wait for its resume (or its silence)
                    log.warning("trainer rank %d: no route to its data connection; waiting "
                                "for it to reconnect", rank)  # fmt: skip
                    self.counters["unreachable"] += 1
                peer.connected = False
                break
        # ZeroMQ's FD is edge-triggered and a send may consume the edge of a message that
        # arrived meanwhile: look, so that the receive loop cannot sleep on a waiting message.
        if cast(int, self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._readable.set()

    def _count_disconnects(self) -> None:
        """The ROUTER's monitor fired: count connections cut (by a peer or by MAXMSGSIZE)
        and handshakes refused (a peer without the run's CURVE keys)."""
        while True:
            try:
                event = recv_monitor_message(self._mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.counters["disconnects"] += event["event"] == zmq.EVENT_DISCONNECTED
            if event["event"] & REFUSED_EVENTS:
                self.counters["refused"] += 1
                self._refused_log()

    def _refused_log(self) -> None:
        n = self.counters["refused"]
        if n & (n - 1) == 0:  # 1, 2, 4, 8, ...: bounded, never silent
            log.warning("experience channel: %d connection(s) refused so far (no valid CURVE "
                        "keys: not a process of this run)", n)  # fmt: skip

    async def _recv_next(self) -> list[zmq.Frame]:
        """The next incoming message (waits on the socket's FD between messages)."""
        while True:
            try:
                return self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass
            self._readable.clear()
            if not cast(int, self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                await self._readable.wait()

    async def _recv_loop(self) -> None:
        n = 0
        while True:
            parts = await self._recv_next()
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
            for seq in msg.acked:
                item = peer.pending.pop(seq, None)
                if item is not None:
                    self.counters["acked"] += 1
                    if item.in_ring:
                        assert peer.ring is not None
                        peer.ring.free(seq)
            if msg.acked and peer.controls:  # it had every broadcast sent before those
                last = max(msg.acked)
                peer.controls = [c for c in peer.controls if c.position > last]
            peer.credit += max(0, msg.grant)
            await self._pump(rank)
        elif isinstance(msg, StepDone | Saved | Synced | Shutdown | EnginesSynced):
            self._reports.put_nowait(msg)
        else:
            raise MalformedMessage("protocol", f"a consumer may not send {type(msg).__name__}")

    async def _hello(self, ident: bytes, msg: Hello) -> None:
        if msg.world_size != self.world_size or not 0 <= msg.rank < self.world_size:
            raise MalformedMessage(
                "protocol",
                f"hello rank {msg.rank}/{msg.world_size}, expected world {self.world_size}",
            )
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
                peer.resend = collections.deque(peer.pending)
                peer.controls, peer.n_controls = [], 0  # the caller re-sends what it needs
            else:  # its first Hello: what was broadcast before it, in order with the batches
                first: list[int | _Ctl] = [*peer.pending, *peer.controls]
                first.sort(key=lambda x: (x.position, 0) if isinstance(x, _Ctl) else (x, 1))
                peer.resend = collections.deque(first)
            # a producer that restarted continues the seqs this incarnation has seen
            peer.next_seq = max(peer.next_seq, msg.last_seq + 1)
        self.counters["redelivered"] += len(peer.resend)
        peer.ident, peer.incarnation, peer.credit = ident, msg.incarnation, msg.credit
        peer.alive, peer.connected, peer.last_seen = True, True, time.monotonic()
        peer.max_bytes = max(0, msg.max_bytes)
        peer.shm = self.uses_shm and msg.shm == self._token
        if peer.shm:
            if peer.ring is None:
                peer.ring = RingWriter(self._shm_bytes)
                log.info("trainer rank %d shares this host: batches via ring %s (%d MiB)",
                         msg.rank, peer.ring.name, self._shm_bytes >> 20)  # fmt: skip
            ring = Ring(ring=msg.rank, name=peer.ring.name, nbytes=peer.ring.nbytes)
            await self._transmit(msg.rank, encode(ring))  # before any batch that uses it
        await self._pump(msg.rank)

    def _resume(self, rank: int, msg: Hello) -> None:
        """Rank ``rank`` (same incarnation) reconnected after a cut: what it received up to
        ``msg.last_seq`` and does not list as unacked is acked; what follows is redelivered."""
        peer = self._peers[rank]
        held = set(msg.unacked)
        for seq in [s for s in peer.pending if s <= msg.last_seq and s not in held]:
            item = peer.pending.pop(seq)
            self.counters["acked"] += 1
            if item.in_ring and peer.ring is not None:
                peer.ring.free(seq)
        lost: list[int | _Ctl] = [s for s in peer.pending if s > msg.last_seq]
        lost += [c for c in peer.controls if c.index >= msg.controls]
        # in the order first sent: a broadcast went after the seqs before its position
        lost.sort(key=lambda x: (x.position, 0) if isinstance(x, _Ctl) else (x, 1))
        peer.resend = collections.deque(lost)
        self.counters["resumed"] += 1
        log.warning("trainer rank %d reconnected after a cut; redelivering %d message(s) "
                    "after seq %d", rank, len(peer.resend), msg.last_seq)  # fmt: skip

    async def _pump(self, rank: int) -> None:
        """Redeliver pending messages to a new incarnation, as far as its credit allows."""
        peer = self._peers[rank]
        while peer.resend and peer.alive and peer.connected:
            head = peer.resend[0]
            if isinstance(head, _Ctl):  # a broadcast takes no credit
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
                item = self._unring(peer, item)
                peer.pending[seq] = item
            peer.credit -= 1
            await self._transmit(rank, item.frames)

    @staticmethod
    def _unring(peer: _Peer, item: _Pending) -> _Pending:
        """The message as frames: its payload copied out of the ring, which it leaves."""
        assert peer.ring is not None
        batch = msgspec.msgpack.decode(item.frames[0], type=TrainBatch)
        payload = peer.ring.read(batch.offset, item.nbytes - len(item.frames[0]))
        peer.ring.free(batch.seq)
        header = msgspec.msgpack.encode(msgspec.structs.replace(batch, ring=-1, offset=0))
        return _Pending([header, payload], item.episode_ids, len(header) + len(payload))

    def _lose(self, rank: int, why: str) -> None:
        peer = self._peers[rank]
        if not peer.alive:
            return
        peer.alive = False
        seqs = list(peer.pending)
        eids = [e for s in seqs for e in peer.pending[s].episode_ids]
        self.counters["lost_reported"] += len(seqs)
        log.error(
            "trainer rank %d lost (%s): %d unacknowledged message(s), seqs %s, "
            "episodes %s; kept for redelivery",
            rank,
            why,
            len(seqs),
            seqs[:20],
            eids[:50],
        )
        self._reports.put_nowait(ConsumerLost(rank=rank, seqs=seqs, episode_ids=eids))

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self._timeout / 4))
            self._count_disconnects()  # in case an edge of the monitor's FD went unseen
            now = time.monotonic()
            for rank, peer in enumerate(self._peers):
                if peer.alive and now - peer.last_seen > self._timeout:
                    self._lose(rank, f"silent for {now - peer.last_seen:.1f}s")
                    self._changed.set()
