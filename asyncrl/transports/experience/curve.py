"""ZeroMQ CURVE on the experience channel's TCP connections (keys from the run secret).

The producer's ROUTER is a CURVE server with the server key pair of
:func:`asyncrl.secret.curve_keys`; every consumer DEALER is a CURVE client with the client
key pair and the server's public key. Both pairs derive from the run secret, so a peer
without it can neither complete the handshake (it does not know the server's public key:
its Hello cannot be decrypted) nor be admitted (the producer's ZAP handler, :class:`Zap`,
admits the client public key of the run and no other). Everything after the handshake is
encrypted and authenticated per message (CurveZMQ): no frame can be injected or read.

Refused handshakes (a plain peer, a wrong server key, a wrong client key) are counted by
the producer's socket monitor (:data:`REFUSED_EVENTS`); the connection is dropped and the
run goes on. ``ipc://`` endpoints (a socket file only the run's user can open) and
``inproc://`` stay plain: CURVE is for TCP, which another host or user can reach.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
from zmq.utils import z85

from asyncrl import secret as run_secret

__all__ = ["REFUSED_EVENTS", "Zap", "curve_client", "curve_server", "uses_curve"]

log = logging.getLogger(__name__)

REFUSED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
"""Monitor events of a connection whose handshake the producer refused."""

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # RFC 27: where libzmq asks a context's ZAP handler


def uses_curve(endpoint: str, curve: bool) -> bool:
    """Whether a connection to/at ``endpoint`` runs CURVE (``curve`` on and TCP)."""
    return curve and endpoint.startswith("tcp://")


def curve_server(sock: zmq.Socket, secret: str | None = None) -> None:
    """Make ``sock`` (before it binds) a CURVE server with the run's server key pair."""
    server_public, server_secret, _, _ = run_secret.curve_keys(secret)
    sock.curve_server = True
    sock.curve_publickey = server_public
    sock.curve_secretkey = server_secret
    sock.zap_domain = b"asyncrl"


def curve_client(sock: zmq.Socket, secret: str | None = None) -> None:
    """Make ``sock`` (before it connects) a CURVE client of the run's producer."""
    server_public, _, client_public, client_secret = run_secret.curve_keys(secret)
    sock.curve_serverkey = server_public
    sock.curve_publickey = client_public
    sock.curve_secretkey = client_secret


class Zap:
    """The ZAP handler (RFC 27) of one context, served on an asyncio loop: admits a CURVE
    client whose public key is the run's client key, refuses any other (``refused`` counts
    what reached it; earlier failures, e.g. a wrong server key, never do). Create before
    the server socket binds; :meth:`close` with the context."""

    def __init__(self, ctx: zmq.Context, secret: str | None = None):
        _, _, client_public, _ = run_secret.curve_keys(secret)
        self._allowed = z85.decode(client_public)
        self.refused = 0
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._fd = int(self._sock.getsockopt(zmq.FD))
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._serve)
        self._serve()  # reading arms ZeroMQ's edge-triggered FD

    def _serve(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._sock.send_multipart(self._answer(frames))

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        """RFC 27 request ``version, id, domain, address, identity, mechanism, *credentials``
        -> reply ``version, id, status, text, user id, metadata``."""
        version, rid = frames[:2] if len(frames) >= 2 else [b"1.0", b""]
        ok = (
            len(frames) >= 7
            and frames[5] == b"CURVE"
            and frames[6] == self._allowed  # the client's long-term public key, 32 bytes
        )
        if not ok:
            self.refused += 1
            peer = frames[3].decode(errors="replace") if len(frames) > 3 else "?"
            log.debug("experience channel: refused a peer at %s (not the run's key)", peer)
            return [version, rid, b"400", b"not the run's key", b"", b""]
        return [version, rid, b"200", b"OK", b"trainer", b""]

    def close(self) -> None:
        self._loop.remove_reader(self._fd)
        self._sock.close(0)
