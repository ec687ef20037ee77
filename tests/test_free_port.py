"""``asyncrl.procs.free_port``: a port the kernel's own random choices cannot take."""

from __future__ import annotations

import socket

import zmq

from asyncrl.procs import _ephemeral_low, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_bind() -> None:
    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert all(20_000 <= p < low for p in ports), (low, ports)  # Ray's workers: <= 19999
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # it was free


def test_the_kernels_random_binds_never_land_on_a_free_port() -> None:
    """What raced before: a port from ``free_port`` (the engine still loading its model)
    taken by a neighbour's ``tcp://127.0.0.1:*`` bind, so the health probe met a ZeroMQ
    greeting. Such binds and outgoing connections draw from the ephemeral range only."""
    low = _ephemeral_low()
    ctx = zmq.Context()
    socks = []
    try:
        for _ in range(200):
            sock = ctx.socket(zmq.ROUTER)
            sock.bind("tcp://127.0.0.1:*")
            socks.append(sock)
            port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
            assert port >= low
        assert all(free_port() < low for _ in range(20))
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
