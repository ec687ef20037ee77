"""Hostile input on the experience channel, over real sockets on 127.0.0.1 (issue 15, defect 6).

A frame over the size limit makes libzmq cut the connection (ZMQ_MAXMSGSIZE; on the
connecting side a protocol error ends the session for good): the channel must restore
it and lose nothing. A header must not cost the receiver more than its limit allows
before it is validated, and an element beyond the known fields is rejected.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import zmq

from asyncrl.procs import spawn, stop
from asyncrl.transports.experience.codec import decode, encode, encode_batch
from asyncrl.transports.experience.control import Save, StepDone
from asyncrl.transports.experience.curve import curve_server
from asyncrl.transports.experience.wire import TrainBatch, TrajMeta
from asyncrl.transports.experience.zmq_recv import ExperienceReceiver
from asyncrl.transports.experience.zmq_send import ExperienceSender

sys.path.insert(0, str(Path(__file__).parent))
from peers import await_data_hello, crc, make_traj

PEERS = str(Path(__file__).with_name("peers.py"))
LIMIT = 1 << 16
BIG = b"\x5a" * (LIMIT + 1)  # one frame over the limit on both sides


def _ident(tx: ExperienceSender, prefix: bytes) -> bytes:
    """The routing id of the rank-0 connection whose id starts with ``prefix`` (d/c)."""
    (ident,) = [i for i in tx._by_ident if i.startswith(prefix)]
    return ident


async def _until(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("side", ["producer", "consumer"])
async def test_a_frame_over_the_limit_on_the_data_connection_loses_nothing(side: str) -> None:
    """The frame cuts the data connection (either way); every message still arrives once,
    in order, bit-exact, and the stream goes on promptly; so does a broadcast (a Save)
    sent on the doomed connection."""
    n, cut_after = 40, 10
    tx = ExperienceSender(1, "tcp://127.0.0.1:*", max_message_bytes=LIMIT, shm="off")
    rx = ExperienceReceiver(
        [tx.endpoint], 0, 1, credits=4, max_message_bytes=LIMIT, heartbeat_s=0.2, shm=False
    )
    sent = {i: make_traj(i, i, n_resp=32 + i) for i in range(n)}
    got: list[tuple[int, int]] = []
    saves: list[tuple[int, int]] = []  # (step, batches received before it)
    cut = threading.Event()

    def consume() -> None:
        while len(got) < n:
            d = rx.recv(10.0)
            assert d is not None, f"stalled after {[e for e, _ in got]}"
            if isinstance(d.msg, Save):
                saves.append((d.msg.step, len(got)))
            got.extend((t.episode_id, crc(t)) for t in d.trajs)
            if side == "consumer" and len(got) == cut_after:
                rx._data[0].send(BIG)  # what a broken consumer could send: the ROUTER cuts it
                cut.set()
            rx.ack(d, flush=len(got) == n)

    async def produce() -> None:
        await tx.wait_peers(10)
        for i in range(n):
            await tx.send([sent[i]], rank=0)
            if side == "producer" and i == cut_after:  # into the stream, between batches
                tx._socket.send_now(_ident(tx, b"d"), [BIG])
            if i == cut_after:
                await tx.broadcast(Save(step=99))

    t0 = time.monotonic()
    try:
        await asyncio.wait_for(asyncio.gather(produce(), asyncio.to_thread(consume)), 30)
        elapsed = time.monotonic() - t0
        assert [e for e, _ in got] == list(range(n))  # once each, in order
        assert all(c == crc(sent[e]) for e, c in got)  # bit-exact
        assert saves == [(99, cut_after + 1)]  # once, in its place
        assert elapsed < 10, f"{elapsed:.1f}s for {n} messages"
        await _until(lambda: tx.pending(0) == 0, "every message acked")
        if side == "producer":
            assert rx.reconnects == 1 and tx.counters["resumed"] == 1
        else:
            assert cut.is_set()
            await _until(lambda: tx.counters["disconnects"] >= 1, "the cut counted")
        assert rx.rejected == 0 and tx.rejected == 0
    finally:
        rx.close()
        await tx.close()


@pytest.mark.parametrize("side", ["producer", "consumer"])
async def test_a_frame_over_the_limit_on_the_control_connection_is_survived(side: str) -> None:
    """Reports still arrive after the control connection was cut, either way."""
    tx = ExperienceSender(1, "tcp://127.0.0.1:*", max_message_bytes=LIMIT, shm="off")
    rx = ExperienceReceiver(
        [tx.endpoint], 0, 1, credits=2, max_message_bytes=LIMIT, heartbeat_s=0.1, shm=False
    )
    try:
        await tx.wait_peers(10)
        await _until(lambda: any(i.startswith(b"c") for i in tx._by_ident), "control hello")
        if side == "producer":  # a ROUTER sends on the control connection: libzmq cuts it
            tx._socket.send_now(_ident(tx, b"c"), [BIG])
            await _until(lambda: rx.reconnects == 1, "the control connection restored")
        else:
            with rx._ctl_lock:
                rx._ctl[0].send(BIG)
            await _until(lambda: tx.counters["disconnects"] >= 1, "the cut counted")
        rx.report(StepDone(step=3, version=4))
        msg = await asyncio.wait_for(tx.recv_report(), 10)
        assert msg == StepDone(step=3, version=4)
        await tx.send([make_traj(1, 1)], rank=0)  # the data connection is untouched
        d = await asyncio.to_thread(rx.recv, 10.0)
        assert d is not None and d.trajs[0].episode_id == 1
    finally:
        rx.close()
        await tx.close()


async def test_oversized_reports_and_messages_are_refused_by_their_sender() -> None:
    """Our own peers never send what the other side's socket would cut on: a report over
    the limit, a batch over the consumer's (smaller) limit."""
    tx = ExperienceSender(1, "tcp://127.0.0.1:*", max_message_bytes=1 << 20, shm="off")
    rx = ExperienceReceiver([tx.endpoint], 0, 1, credits=2, max_message_bytes=LIMIT, shm=False)
    try:
        with pytest.raises(ValueError, match="max_message_mb"):
            rx.report(StepDone(step=1, version=1, metrics={f"m{i}": 1.0 for i in range(9000)}))
        await tx.wait_peers(10)
        with pytest.raises(ValueError, match="rank 0's"):
            await tx.send([make_traj(0, 0, n_resp=LIMIT // 8)], rank=0)
        many = [make_traj(i, 0, n_resp=0) for i in range(65)]  # LIMIT / 1024 = 64 allowed
        with pytest.raises(ValueError, match="at most 64 trajectories"):
            await tx.send(many, rank=0)
        await tx.send(many[:64], rank=0)
        d = await asyncio.to_thread(rx.recv, 10.0)
        assert d is not None and len(d.trajs) == 64 and rx.rejected == 0
    finally:
        rx.close()
        await tx.close()


def test_a_header_of_a_million_empty_trajectories_costs_the_receiver_nothing(
    tmp_path: Path,
) -> None:
    """7.7 MB of header listing 1.1M trajectories without arrays (it cost 1.2 GB to decode):
    rejected before any object is built; a valid message after it arrives bit-exact."""
    n = 1_100_000
    header = msgspec.msgpack.encode(["batch", 0, 0, [[[0, 0], 0, 0, 0]] * n])
    assert 7_500_000 < len(header) < 8_000_000
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    curve_server(router)  # a producer of the run: the consumer speaks CURVE on tcp
    port = router.bind_to_random_port("tcp://127.0.0.1")
    out = tmp_path / "probe.json"
    probe = spawn(
        [PEERS, "probe", "--endpoints", f"tcp://127.0.0.1:{port}", "--out", str(out)],
        tmp_path / "probe.log",
    )
    try:
        ident, _ = await_data_hello(router)
        good = make_traj(7, 3, n_resp=64)
        router.send_multipart([ident, header, b""])
        router.send_multipart([ident, *encode_batch(0, 0, [good])])
        assert probe.wait(60) == 0, (tmp_path / "probe.log").read_text()
        row = json.loads(out.read_text())
        grew_mb = (row["rss_after_kb"] - row["rss_before_kb"]) / 1024
        assert row["rejected_by"] == {"oversized": 1}, row
        assert row["eid"] == 7 and row["crc"] == crc(good)
        assert grew_mb < 64, f"receiver's peak RSS grew {grew_mb:.0f} MB"
    finally:
        stop([probe])
        router.close(linger=0)
        ctx.term()


def _extra_element_cases() -> dict[str, list[bytes]]:
    valid = [bytes(f) for f in encode_batch(0, 0, [make_traj(1, 1)])]
    head = msgspec.msgpack.decode(valid[0])
    meta = list(head[3][0])
    ctl = msgspec.msgpack.decode(encode(StepDone(step=1, version=2))[0])
    return {
        "batch header": [msgspec.msgpack.encode([*head, 7, 8, 9, 10]), valid[1]],
        "trajectory entry": [
            msgspec.msgpack.encode([*head[:3], [[*meta, {}, {}, {}, 0]]]),
            valid[1],
        ],
        "control message": [msgspec.msgpack.encode([*ctl, {}, 1])],
    }


@pytest.mark.parametrize("case", list(_extra_element_cases()))
def test_an_element_beyond_the_known_fields_is_rejected(case: str) -> None:
    frames = _extra_element_cases()[case]
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    curve_server(router)  # a producer of the run: the consumer speaks CURVE on tcp
    port = router.bind_to_random_port("tcp://127.0.0.1")
    rx = ExperienceReceiver([f"tcp://127.0.0.1:{port}"], 0, 1, credits=2, shm=False)
    try:
        ident, _ = await_data_hello(router)
        router.send_multipart([ident, *frames])
        good = make_traj(2, 2)
        router.send_multipart([ident, *encode_batch(0, 0, [good])])
        d = rx.recv(10.0)
        assert d is not None and isinstance(d.msg, TrainBatch) and d.trajs[0].episode_id == 2
        assert rx.rejected_by == {"bad_header": 1}
    finally:
        rx.close()
        router.close(linger=0)
        ctx.term()


def test_header_caps_follow_the_limit() -> None:
    """A header over limit/32 bytes or listing more than limit/1024 trajectories is rejected
    as oversized, whatever its total size."""
    limit = 1 << 20
    meta = TrajMeta(lengths=(0, 0), reward=0.0, group_id=0, episode_id=0)
    ok = msgspec.msgpack.encode(TrainBatch(seq=0, step=0, trajs=[meta] * 1024))
    decode([ok, b""], limit)
    many = msgspec.msgpack.encode(TrainBatch(seq=0, step=0, trajs=[meta] * 1025))
    fat = TrajMeta(
        lengths=(0, 0), reward=0.0, group_id=0, episode_id=0, metadata={"x": "y" * 33_000}
    )
    big = msgspec.msgpack.encode(TrainBatch(seq=0, step=0, trajs=[fat]))
    for frames in ([many, b""], [big, b""]):
        with pytest.raises(ValueError, match="oversized"):
            decode(frames, limit)
