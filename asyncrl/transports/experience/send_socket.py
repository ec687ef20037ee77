"""The producer's ROUTER socket, driven by the event loop (run by the sending process).

Contract: :class:`RouterSocket` binds the experience channel's ROUTER (CURVE on TCP, keys
from the run secret: :mod:`.curve`; libzmq's MAXMSGSIZE cutting a peer that sends a larger
frame), sends without ever blocking (SNDHWM 0: the sender's credits bound what is
queued), hands out incoming messages one at a time, and counts what its monitor sees
(``disconnects``, ``refused`` in the counters it is given). It knows no protocol: ranks,
credits and redelivery are :class:`~asyncrl.transports.experience.zmq_send.ExperienceSender`'s.

A plain (blocking-API) socket: sends skip zmq.asyncio's per-call future machinery (about
8 us per message); the loop watches the socket's FD for incoming messages. ZeroMQ's FD is
edge-triggered, so every send looks for a message that arrived meanwhile (:meth:`poke`).

Authentication (``curve``, on by default): on a TCP endpoint the ROUTER is a ZeroMQ CURVE
server whose keys derive from the run secret (:mod:`.curve`); only consumers holding the
secret complete the handshake, and everything on the wire is encrypted. Refused handshakes
are counted in ``counters["refused"]`` (the monitor's HANDSHAKE_FAILED events) and change
nothing else.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from asyncrl.transports.experience.curve import REFUSED_EVENTS, Zap, curve_server, uses_curve

__all__ = ["RouterSocket"]

log = logging.getLogger(__name__)


class RouterSocket:
    """The bound ROUTER at ``endpoint`` (``self.endpoint``: with the real port); create it
    inside a running event loop, :meth:`close` it there. ``curve``: CURVE on a TCP endpoint,
    keys from ``secret`` (default: this process's run secret)."""

    def __init__(
        self,
        endpoint: str,
        max_message_bytes: int,
        curve: bool,
        secret: str | None,
        counters: collections.Counter[str],
    ):
        self._counters = counters
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
        loop = asyncio.get_running_loop()
        self.readable = asyncio.Event()  # the socket's FD fired: messages may be waiting
        self._fd = cast(int, self._sock.getsockopt(zmq.FD))  # an int option
        loop.add_reader(self._fd, self.readable.set)
        self._mon = self._sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | REFUSED_EVENTS, f"inproc://xport-router-{id(self):x}"
        )
        self._mon_fd = cast(int, self._mon.getsockopt(zmq.FD))  # an int option
        loop.add_reader(self._mon_fd, self.count_events)
        self.count_events()  # reading arms ZeroMQ's edge-triggered FD

    async def transmit(self, ident: bytes, frames: list[Any]) -> bool:
        """Send ``frames`` to the peer ``ident`` (zero-copy); False when there is no route to
        it (``EHOSTUNREACH``: its connection is gone), the message unsent."""
        sent = True
        while True:
            try:
                self._sock.send_multipart([ident, *frames], zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:  # not expected with SNDHWM 0; wait rather than drop
                await asyncio.sleep(0.001)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                sent = False
                break
        self.poke()
        return sent

    def send_now(self, ident: bytes, frames: list[bytes]) -> None:
        """Send ``frames`` to ``ident`` at once, copied (``zmq.ZMQError`` when it cannot be
        sent); call :meth:`poke` after a series of these."""
        self._sock.send_multipart([ident, *frames], zmq.NOBLOCK)

    def poke(self) -> None:
        """A send may consume the edge of a message that arrived meanwhile: look, so that
        the receive loop cannot sleep on a waiting message."""
        if cast(int, self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self.readable.set()

    async def recv_next(self) -> list[zmq.Frame]:
        """The next incoming message (waits on the socket's FD between messages)."""
        while True:
            try:
                return self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass
            self.readable.clear()
            if not cast(int, self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                await self.readable.wait()

    def stop_reading(self) -> None:
        """Stop watching the socket's FD (nobody reads the socket any more: it may stay
        readable)."""
        asyncio.get_running_loop().remove_reader(self._fd)

    def count_events(self) -> None:
        """The monitor fired: count connections cut (by a peer or by MAXMSGSIZE) and
        handshakes refused (a peer without the run's CURVE keys)."""
        while True:
            try:
                event = recv_monitor_message(self._mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._counters["disconnects"] += event["event"] == zmq.EVENT_DISCONNECTED
            if event["event"] & REFUSED_EVENTS:
                self._counters["refused"] += 1
                self._refused_log()

    def _refused_log(self) -> None:
        n = self._counters["refused"]
        if n & (n - 1) == 0:  # 1, 2, 4, 8, ...: bounded, never silent
            log.warning("experience channel: %d connection(s) refused so far (no valid CURVE "
                        "keys: not a process of this run)", n)  # fmt: skip

    def close(self) -> None:
        """Stop watching both FDs, close the monitor, the socket, the ZAP handler and the
        context."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._fd)
        loop.remove_reader(self._mon_fd)
        self._sock.disable_monitor()
        self._mon.close(linger=0)
        self._sock.close(linger=0)
        if self._zap is not None:
            self._zap.close()
        self._ctx.term()
