"""CURVE on the experience channel: a peer without the run secret is refused, counted, and
the run's own consumers go on (real sockets on 127.0.0.1, the real libzmq handshake)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import zmq

from asyncrl import secret
from asyncrl.transports.experience.codec import encode
from asyncrl.transports.experience.curve import curve_client
from asyncrl.transports.experience.wire import Hello, TrainBatch
from asyncrl.transports.experience.zmq_recv import ExperienceReceiver
from asyncrl.transports.experience.zmq_send import ExperienceSender

sys.path.insert(0, str(Path(__file__).parent))
from peers import make_traj


def _intruders(ctx: zmq.Context, endpoint: str) -> list[zmq.Socket]:
    """Three peers that say a valid control Hello for rank 0, and then a frame: one plain
    (no CURVE), one with another secret's keys, one that knows the server's public key
    (as if it had leaked) but has its own client key pair."""
    plain = ctx.socket(zmq.DEALER)
    other = ctx.socket(zmq.DEALER)
    curve_client(other, secret.generate())
    leaked = ctx.socket(zmq.DEALER)
    leaked.curve_serverkey = secret.curve_keys()[0]
    leaked.curve_publickey, leaked.curve_secretkey = zmq.curve_keypair()
    socks = [plain, other, leaked]
    hello = Hello(rank=0, world_size=1, incarnation=7, control=True)
    for s in socks:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        s.send_multipart(encode(hello))
        s.send_multipart([b"\x00injected"])
    return socks


async def _until(cond, what: str, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"the producer never saw {what} in {timeout_s}s")
        await asyncio.sleep(0.05)


async def test_peers_without_the_key_are_refused_counted_and_the_run_goes_on() -> None:
    tx = ExperienceSender(1, "tcp://127.0.0.1:*", shm="off")
    assert tx.curve
    ctx = zmq.Context()
    socks = _intruders(ctx, tx.endpoint)
    rx = None
    try:
        await _until(lambda: tx.counters["refused"] >= 3, "three refused handshakes")
        with pytest.raises(TimeoutError, match="did not connect"):
            await tx.wait_peers(0.5)  # no Hello got through: rank 0 is unclaimed
        assert tx.rejected == 0  # no frame of theirs reached the decoder either
        rx = ExperienceReceiver([tx.endpoint], 0, 1, credits=2, heartbeat_s=0.2)
        await tx.wait_peers(20)
        await tx.send([make_traj(1, 0)], 0, step=5)
        d = await asyncio.to_thread(rx.recv, 20)
        assert d is not None and isinstance(d.msg, TrainBatch) and d.msg.step == 5
        assert [t.episode_id for t in d.trajs] == [1]
        refused = tx.counters["refused"]

        def counted() -> bool:
            tx._socket.count_events()
            return tx.counters["refused"] > refused

        await _until(counted, "the intruders' next retry refused")  # each retry is counted
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        if rx is not None:
            await asyncio.to_thread(rx.close)
        await tx.close()


async def test_consumer_with_another_secret_cannot_join() -> None:
    """The run's own receiver class, given another secret: never a peer."""
    tx = ExperienceSender(1, "tcp://127.0.0.1:*", shm="off")
    rx = ExperienceReceiver([tx.endpoint], 0, 1, heartbeat_s=0.2, secret=secret.generate())
    try:
        await _until(lambda: tx.counters["refused"] >= 1, "a refused handshake")
        with pytest.raises(TimeoutError):
            await tx.wait_peers(0.5)
    finally:
        await asyncio.to_thread(rx.close)
        await tx.close()


async def test_curve_off_and_ipc_stay_plain(tmp_path: Path) -> None:
    """``curve=False`` (the bench's baseline) and ``ipc://`` (a socket file of the run's
    user) run without CURVE; a plain consumer joins them."""
    for endpoint, curve in (("tcp://127.0.0.1:*", False), (f"ipc://{tmp_path}/x.ipc", True)):
        tx = ExperienceSender(1, endpoint, shm="off", curve=curve)
        assert not tx.curve
        rx = ExperienceReceiver([tx.endpoint], 0, 1, heartbeat_s=0.2, curve=curve)
        try:
            await tx.wait_peers(20)
            assert tx.counters["refused"] == 0
        finally:
            await asyncio.to_thread(rx.close)
            await tx.close()
