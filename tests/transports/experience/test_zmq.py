"""The ZeroMQ experience channel over real sockets and real processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from asyncrl.core import ARRAY_FIELDS
from asyncrl.procs import spawn, stop
from asyncrl.transports.experience.codec import decode, encode, encode_batch, encode_header
from asyncrl.transports.experience.control import ConsumerLost, Engines, Save, Shutdown, StepDone
from asyncrl.transports.experience.curve import curve_client, curve_server
from asyncrl.transports.experience.shm import ALIGN, RingWriter
from asyncrl.transports.experience.wire import (
    SCHEMA_VERSION,
    Credit,
    Hello,
    Ring,
    TrainBatch,
    TrajMeta,
)
from asyncrl.transports.experience.zmq_recv import Delivery, ExperienceReceiver
from asyncrl.transports.experience.zmq_send import ExperienceSender, bind_endpoint

sys.path.insert(0, str(Path(__file__).parent))
from peers import await_data_hello, make_traj

PEERS = str(Path(__file__).with_name("peers.py"))
WAIT_S = 60.0  # longest wait for a peer to do what it must, however loaded the machine


def _endpoint(kind: str, tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/x.ipc" if kind == "ipc" else "tcp://127.0.0.1:*"


def _read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def _recv(rx: ExperienceReceiver, timeout_s: float = 60.0) -> Delivery:
    d = await asyncio.to_thread(rx.recv, timeout_s)
    assert d is not None, "nothing received in time"
    return d


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
async def test_round_trip_groups_to_ranks_and_reports(kind: str, tmp_path: Path) -> None:
    tx = ExperienceSender(2, _endpoint(kind, tmp_path))
    assert tx.endpoint.startswith(f"{kind}://")
    if kind == "tcp":
        assert tx.endpoint.startswith("tcp://127.0.0.1:")
    rxs = [ExperienceReceiver([tx.endpoint], r, 2, credits=2, heartbeat_s=0.2) for r in range(2)]
    try:
        groups = [[make_traj(g * 10 + k, g, n_resp=5 + k) for k in range(3)] for g in range(5)]
        ranks = await tx.send_groups(groups, step=3)
        assert sorted(np.bincount(ranks, minlength=2)) == [2, 3]
        for r, rx in enumerate(rxs):
            d = await _recv(rx)
            assert isinstance(d.msg, TrainBatch) and d.msg.step == 3 and d.msg.seq == 0
            want = [t for g, gr in zip(groups, ranks, strict=True) if gr == r for t in g]
            assert [t.episode_id for t in d.trajs] == [t.episode_id for t in want]
            for a, b in zip(want, d.trajs, strict=True):
                for name in ARRAY_FIELDS:
                    np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
                assert (a.reward, a.group_id) == (b.reward, b.group_id)
            rx.ack(d)
        rxs[0].report(StepDone(step=3, version=4, metrics={"loss": 1.0}))
        assert await asyncio.wait_for(tx.recv_report(), WAIT_S) == StepDone(3, 4, {"loss": 1.0})
        assert await tx.broadcast(Shutdown(reason="done")) == len(rxs)  # handed to each
        for rx in rxs:
            assert (await _recv(rx)).msg == Shutdown(reason="done")
        for _ in range(100):
            if tx.pending(0) == tx.pending(1) == 0:
                break
            await asyncio.sleep(0.05)
        assert tx.counters["acked"] == 2 and tx.rejected == 0
    finally:
        for rx in rxs:
            rx.close()
        await tx.close()


async def test_a_broadcast_before_a_ranks_first_hello_reaches_it_after_that_hello() -> None:
    """A stop while the trainer is still starting: ``Save`` is broadcast before rank 0 has
    said Hello. It is not counted as handed over, but the rank gets it right after its first
    Hello, before the batch sent after it (was: dropped, and the run waited for a ``Saved``
    that could never come until ``checkpoint.timeout_s``)."""
    tx = ExperienceSender(1, "tcp://127.0.0.1:*")
    rx: ExperienceReceiver | None = None
    try:
        save = Save(step=0, checkpoint="/nowhere/trainer", export="")
        assert await tx.broadcast(save) == 0  # no rank has said Hello
        sending = asyncio.ensure_future(tx.send([make_traj(1, 0)], rank=0, step=0))
        rx = ExperienceReceiver([tx.endpoint], 0, 1, credits=2, heartbeat_s=0.2)
        first, second = await _recv(rx), await _recv(rx)
        assert first.msg == save
        assert isinstance(second.msg, TrainBatch) and second.msg.step == 0
        await asyncio.wait_for(sending, WAIT_S)
        assert await tx.broadcast(Shutdown(reason="done")) == 1  # said Hello: counted now
        assert (await _recv(rx)).msg == Shutdown(reason="done")
    finally:
        if rx is not None:
            rx.close()
        await tx.close()


def test_many_producers_keep_order_and_groups_stay_on_their_rank(tmp_path: Path) -> None:
    n_prod, world, groups, per_group = 3, 2, 6, 3
    procs: list[subprocess.Popen] = []
    rxs: list[ExperienceReceiver] = []
    try:
        files = [tmp_path / f"ep{p}" for p in range(n_prod)]
        for p in range(n_prod):
            args = [PEERS, "producer", "--world", str(world), "--id", str(p)]
            args += ["--groups", str(groups), "--per-group", str(per_group)]
            args += ["--endpoint-file", str(files[p])]
            procs.append(spawn(args, tmp_path / f"producer{p}.log"))
        deadline = time.monotonic() + 60
        while not all(f.exists() and f.read_text() for f in files):
            assert time.monotonic() < deadline, "producers did not start"
            assert all(p.poll() is None for p in procs), "a producer died"
            time.sleep(0.1)
        endpoints = [f.read_text() for f in files]
        rxs = [ExperienceReceiver(endpoints, r, world, credits=2) for r in range(world)]
        got: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # rank -> (prod, seq, eid)
        total = n_prod * groups * per_group
        while sum(len(v) for v in got.values()) < total:
            assert time.monotonic() < deadline + 60, f"received only {dict(got)}"
            for r, rx in enumerate(rxs):
                d = rx.recv(0.05)
                if d is not None:
                    got[r] += [(d.producer, d.msg.seq, t.episode_id) for t in d.trajs]
                    assert all(t.group_id % world == r for t in d.trajs)  # modulo policy
                    rx.ack(d)
        eids = [e for v in got.values() for _, _, e in v]
        assert len(eids) == len(set(eids)) == total
        for rows in got.values():
            for p in range(n_prod):
                mine = [(s, e) for q, s, e in rows if q == p]
                assert [s for s, _ in mine] == list(range(len(mine)))  # per-producer FIFO
                assert [e for _, e in mine] == sorted(e for _, e in mine)
        for p in procs:
            assert p.wait(30) == 0  # each producer exits once everything is acked
    finally:
        for rx in rxs:
            rx.close()
        stop(procs)


async def test_stalled_consumer_bounds_producer_and_loses_nothing(tmp_path: Path) -> None:
    credits, n = 3, 12
    tx = ExperienceSender(1, _endpoint("ipc", tmp_path))
    rx = ExperienceReceiver([tx.endpoint], 0, 1, credits=credits, heartbeat_s=0.2)
    msgs = [[make_traj(i, i, n_resp=4096)] for i in range(n)]
    size = sum(getattr(msgs[0][0], f).nbytes for f in ARRAY_FIELDS)

    async def produce() -> None:
        for m in msgs:
            await tx.send(m, rank=0)

    task = asyncio.create_task(produce())
    try:
        # the consumer reads nothing meanwhile. No quiet window: once the credits are sent,
        # the producer's loop handles three more of the consumer's heartbeats (each one it
        # could have sent on after) and still sends nothing more
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while tx.counters["sent"] < credits:
            assert loop.time() < deadline, f"sent {tx.counters['sent']} of {credits} credits"
            await asyncio.sleep(0.01)
        for _ in range(3):
            seen = tx._peers[0].last_seen
            while tx._peers[0].last_seen == seen:
                assert loop.time() < deadline, "no heartbeat from the consumer"
                await asyncio.sleep(0.01)
        assert not task.done()
        assert tx.counters["sent"] == credits and tx.pending(0) == credits
        assert tx.pending_bytes() <= credits * (size + 1024)
        got = []
        while len(got) < n:
            d = await _recv(rx)
            got += [t.episode_id for t in d.trajs]
            assert tx.pending(0) <= credits
            rx.ack(d)
        await asyncio.wait_for(task, 10)
        assert got == list(range(n)) and rx.rejected == 0
    finally:
        task.cancel()
        rx.close()
        await tx.close()


async def test_killed_consumer_is_reported_and_redelivered(tmp_path: Path) -> None:
    n = 30
    tx = ExperienceSender(1, _endpoint("tcp", tmp_path), peer_timeout_s=1.5)
    out1, out2 = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    common = [PEERS, "consumer", "--endpoints", tx.endpoint, "--credits", "4"]
    first = spawn([*common, "--out", str(out1), "--ack-delay", "0.1"], tmp_path / "c1.log")
    second = None
    sent: list[int] = []

    async def produce() -> None:
        for i in range(n):
            await tx.send([make_traj(i, i)], rank=0)
            sent.append(i)

    task = asyncio.create_task(produce())
    try:
        deadline = time.monotonic() + 60
        while len(_read_rows(out1)) < 5:  # mid-stream
            assert time.monotonic() < deadline and first.poll() is None, "consumer did not run"
            await asyncio.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        lost = await asyncio.wait_for(tx.recv_report(), 20)
        assert isinstance(lost, ConsumerLost) and lost.rank == 0
        seen_by_first = {r["eid"] for r in _read_rows(out1)}
        # every message sent so far was either acked (so the consumer had it) or is reported
        acked = set(sent) - set(lost.episode_ids)
        assert acked <= seen_by_first
        assert set(lost.episode_ids) | acked == set(sent) and lost.episode_ids
        assert tx.counters["lost_reported"] == len(lost.seqs)
        second = spawn([*common, "--out", str(out2), "--total", str(n - len(acked))])
        await asyncio.wait_for(task, 60)
        assert second.wait(60) == 0
        seen_by_second = [r["eid"] for r in _read_rows(out2)]
        assert seen_by_second[: len(lost.episode_ids)] == lost.episode_ids  # redelivered first
        assert acked | set(seen_by_second) == set(range(n))
        assert tx.counters["redelivered"] == len(lost.seqs)
        for _ in range(100):
            if tx.pending(0) == 0:
                break
            await asyncio.sleep(0.05)
        assert tx.pending(0) == 0
    finally:
        task.cancel()
        stop([p for p in (first, second) if p is not None])
        await tx.close()


def _fuzz_ring(rng: random.Random, ring_header: bytes, ring_bytes: int) -> list[bytes]:
    """A shared-memory message that is invalid by construction (the receiver mapped ring 0)."""
    head = msgspec.msgpack.decode(ring_header, type=TrainBatch)
    rep = msgspec.structs.replace
    kind = rng.randrange(6)
    if kind == 0:  # a ring never announced
        head = rep(head, ring=rng.randrange(1, 1 << 40))
    elif kind == 1:  # misaligned
        head = rep(head, offset=head.offset + rng.randrange(1, ALIGN))
    elif kind == 2:  # out of bounds, before or past the end
        off = rng.choice([-ALIGN * rng.randrange(1, 99), ring_bytes - ALIGN * rng.randrange(0, 2)])
        head = rep(head, offset=off)
    elif kind == 3:  # lengths that run past the end of the ring
        meta = rep(head.trajs[0], lengths=(rng.randrange(0, 9), ring_bytes // 9 + 1))
        head = rep(head, trajs=[meta])
    elif kind == 4:  # a ring batch with a payload frame
        return [ring_header, rng.randbytes(rng.randrange(0, 99))]
    else:  # an announcement of something that is not a ring
        name = rng.choice(["../x", "asyncrl-xp-1-0123456789abcdef", "", "asyncrl-xp-\n"])
        return encode(Ring(ring=rng.randrange(1, 9), name=name, nbytes=rng.randrange(-9, 1 << 20)))
    return [msgspec.msgpack.encode(head)]


def _fuzz_frames(rng: random.Random, valid: list[bytes], big: int) -> list[bytes]:
    """One message that is invalid by construction: random, truncated or mutated."""
    kind = rng.randrange(10)
    if kind == 0:  # random frames (at least one: ZeroMQ carries no zero-frame message)
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 9))]
    if kind == 1:  # truncated header
        return [valid[0][: rng.randrange(len(valid[0]))], *valid[1:]]
    if kind == 2:  # a frame missing
        drop = rng.randrange(len(valid))
        return [f for i, f in enumerate(valid) if i != drop]
    if kind == 3:  # truncated or extended payload frame
        cut = valid[1][: rng.randrange(len(valid[1]))]
        return [valid[0], cut if rng.random() < 0.5 else valid[1] + rng.randbytes(4)]
    if kind == 4:  # wrong dtype (a field sent as 8-byte values) or shape (header lengths off)
        if rng.random() < 0.5:
            wide = np.frombuffer(valid[1], np.uint8).repeat(2).tobytes()
            return [valid[0], wide]
        meta = TrajMeta(lengths=(rng.randrange(0, 9), rng.randrange(65, 99)), reward=0.0,
                        group_id=0, episode_id=0)  # fmt: skip
        return [msgspec.msgpack.encode(TrainBatch(seq=0, step=0, trajs=[meta])), *valid[1:]]
    if kind == 5:  # schema mismatch
        header = TrainBatch(seq=0, step=0, trajs=[], schema=SCHEMA_VERSION + rng.randrange(1, 9))
        return [msgspec.msgpack.encode(header), *valid[1:]]
    if kind == 6:  # unknown message type
        return [msgspec.msgpack.encode([rng.choice(["x", "Batch", "batch2"]), 1, 2, []])]
    if kind == 7:  # a message a producer may not send
        return encode(rng.choice([Credit(grant=5), Hello(rank=0, world_size=1, incarnation=1)]))
    if kind == 8:  # random bytes glued to a valid header
        return [valid[0] + rng.randbytes(rng.randrange(1, 8)), *valid[1:]]
    return [*valid, b"x" * big]  # oversized


def test_fuzz_10k_bad_messages_then_a_valid_one(tmp_path: Path) -> None:
    limit = 1 << 16
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 0)
    router.bind(f"ipc://{tmp_path}/fuzz.ipc")
    rx = ExperienceReceiver(
        [f"ipc://{tmp_path}/fuzz.ipc"], 0, 1, credits=2, max_message_bytes=limit
    )
    ring = RingWriter(1 << 14)
    try:
        data_ident, _ = await_data_hello(router)
        good = make_traj(7, 3, n_resp=64)
        valid = [bytes(f) for f in encode_batch(0, 5, [good])]
        in_ring = encode_header(1, 5, [good], ring=0, offset=ring.write(1, [good], len(valid[1])))
        router.send_multipart([data_ident, *encode(Ring(0, ring.name, ring.nbytes))])
        rng = random.Random(1234)
        n_bad = 10_000
        for _ in range(n_bad):
            if rng.random() < 0.2:  # shared-memory headers and announcements
                frames = _fuzz_ring(rng, in_ring, ring.nbytes)
            else:
                frames = _fuzz_frames(rng, valid, limit)
            router.send_multipart([data_ident, *frames])
        router.send_multipart([data_ident, *valid])
        router.send_multipart([data_ident, in_ring])
        got = [rx.recv(30.0), rx.recv(10.0)]
        assert all(d is not None and isinstance(d.msg, TrainBatch) for d in got), rx.rejected_by
        assert rx.rejected == n_bad, rx.rejected_by
        assert [d.msg.ring for d in got] == [-1, 0]
        for d in got:
            (t,) = d.trajs
            assert t.episode_id == 7 and np.array_equal(t.behav_logprobs, good.behav_logprobs)
        assert rx.recv(0.1) is None
        kinds = {"bad_header", "frame_count", "size", "schema", "oversized", "shm"}
        assert set(rx.rejected_by) >= kinds
    finally:
        rx.close()
        router.close(linger=0)
        ctx.term()
        ring.close()


async def test_sender_rejects_garbage_and_keeps_serving(tmp_path: Path) -> None:
    tx = ExperienceSender(1, "tcp://127.0.0.1:*", max_message_bytes=1 << 16)
    ctx = zmq.Context()
    bad = ctx.socket(zmq.DEALER)
    curve_client(bad)  # garbage from a holder of the run secret (strangers: test_curve.py)
    bad.connect(tx.endpoint)
    rx = ExperienceReceiver([tx.endpoint], 0, 1, credits=2)
    try:
        rng = random.Random(5)
        n_bad = 500
        for i in range(n_bad):
            if i % 3 == 0:
                bad.send_multipart([rng.randbytes(rng.randrange(1, 40))])
            elif i % 3 == 1:  # credit before hello
                bad.send_multipart(encode(Credit(acked=[0], grant=100)))
            else:  # hello for a rank outside the world
                bad.send_multipart(encode(Hello(rank=3, world_size=4, incarnation=1, credit=1)))
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while tx.rejected < n_bad and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert tx.rejected == n_bad
        await tx.send([make_traj(1, 1)], rank=0)
        d = await _recv(rx)
        assert d.trajs[0].episode_id == 1
    finally:
        rx.close()
        bad.close(linger=0)
        ctx.term()
        await tx.close()


async def test_notice_reaches_a_rank_that_never_calls_recv_and_ordered_copies_follow() -> None:
    """``notify`` goes over the control connections: each rank's ``on_notice`` gets it on
    the receiver's own thread while the consumer thread is busy elsewhere (it never calls
    ``recv`` here); anything but Engines there is rejected and the channel keeps serving;
    the ordered copy (``broadcast``) still arrives through ``recv``, behind the batch."""
    tx = ExperienceSender(2, "tcp://127.0.0.1:*")
    got: queue.Queue[tuple[int, Engines, str]] = queue.Queue()
    rxs = [ExperienceReceiver([tx.endpoint], r, 2, credits=2, heartbeat_s=0.2) for r in range(2)]
    for r, rx in enumerate(rxs):
        rx.on_notice = lambda m, r=r: got.put((r, m, threading.current_thread().name))
    try:
        for r, rx in enumerate(rxs):  # a report proves the control connection said Hello
            rx.report(StepDone(step=r, version=r))
        assert {(await asyncio.wait_for(tx.recv_report(), WAIT_S)).step for _ in rxs} == {0, 1}
        notice = Engines(urls=["http://127.0.0.1:1", "http://127.0.0.1:2"], epoch=3)
        assert tx.notify(notice) == 2
        seen = [await asyncio.to_thread(got.get, True, WAIT_S) for _ in rxs]
        assert sorted(r for r, _, _ in seen) == [0, 1]
        assert all(m == notice and name == f"xport-hb{r}" for r, m, name in seen), seen
        assert tx.notify(Shutdown(reason="not a notice")) == 2
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while not all(rx.rejected == 1 for rx in rxs):
            assert asyncio.get_running_loop().time() < deadline, [rx.rejected for rx in rxs]
            await asyncio.sleep(0.05)
        assert [rx.rejected_by for rx in rxs] == [{"protocol": 1}] * 2
        assert got.empty()
        later = Engines(urls=["http://127.0.0.1:1"], epoch=4)
        await tx.send([make_traj(1, 1)], rank=0, step=7)
        await tx.broadcast(later)
        assert tx.notify(later) == 2
        assert (await asyncio.to_thread(got.get, True, WAIT_S))[1] == later
        first, second = await _recv(rxs[0]), await _recv(rxs[0])
        assert isinstance(first.msg, TrainBatch) and second.msg == later
    finally:
        for rx in rxs:
            rx.close()
        await tx.close()


def test_credit_overrun_is_rejected(tmp_path: Path) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    curve_server(router)  # a producer of the run: the consumer speaks CURVE on tcp
    port = router.bind_to_random_port("tcp://127.0.0.1")
    rx = ExperienceReceiver([f"tcp://127.0.0.1:{port}"], 0, 1, credits=2)
    try:
        ident = None
        while ident is None:
            assert router.poll(10_000)
            who, frame = router.recv_multipart()
            hello, _ = decode([frame])
            ident = who if isinstance(hello, Hello) and not hello.control else None
        for i in range(3):  # one more than the credit granted
            router.send_multipart([ident, *encode_batch(i, 0, [make_traj(i, 0)])])
        got = [rx.recv(10.0) for _ in range(2)]
        assert [d.msg.seq for d in got if d is not None] == [0, 1]
        assert rx.recv(0.5) is None
        assert rx.rejected_by == {"protocol": 1}
    finally:
        rx.close()
        router.close(linger=0)
        ctx.term()


async def test_sender_refuses_a_message_over_the_limit() -> None:
    tx = ExperienceSender(1, "tcp://127.0.0.1:*", max_message_bytes=1 << 12)
    rx = ExperienceReceiver([tx.endpoint], 0, 1, credits=1)
    try:
        with pytest.raises(ValueError, match="max_message_mb"):
            await asyncio.wait_for(tx.send([make_traj(0, 0, n_resp=4096)], rank=0), 10)
        with pytest.raises(ValueError, match="out of range"):
            await tx.send([], rank=1)
    finally:
        rx.close()
        await tx.close()


def test_bind_endpoint_from_config(tmp_path: Path) -> None:
    from asyncrl.config import ExperienceConfig

    assert bind_endpoint(ExperienceConfig()) == "tcp://127.0.0.1:*"
    assert bind_endpoint(ExperienceConfig(host="0.0.0.0")) == "tcp://0.0.0.0:*"
    ipc = bind_endpoint(ExperienceConfig(transport="ipc"), tmp_path)
    assert ipc == f"ipc://{tmp_path.resolve()}/experience.ipc"
    assert bind_endpoint(ExperienceConfig(endpoint="tcp://10.1.2.3:5555")) == "tcp://10.1.2.3:5555"
    with pytest.raises(ValueError, match="run folder"):
        bind_endpoint(ExperienceConfig(transport="ipc"))
    with pytest.raises(ValueError, match="peer_timeout_s"):
        ExperienceConfig(heartbeat_s=5.0, peer_timeout_s=6.0)
    with pytest.raises(ValueError, match="credits"):
        ExperienceConfig(credits=0)


@pytest.mark.parametrize("credits", [1, 5, 8])
async def test_streaming_with_batched_acks_never_stalls(credits: int, tmp_path: Path) -> None:
    n = 60
    tx = ExperienceSender(1, _endpoint("ipc", tmp_path))
    rx = ExperienceReceiver([tx.endpoint], 0, 1, credits=credits, heartbeat_s=0.2)

    def consume() -> list[int]:
        got: list[int] = []
        while len(got) < n:
            d = rx.recv(10.0)
            assert d is not None, f"stalled after {got}"
            got += [t.episode_id for t in d.trajs]
            rx.ack(d)
        return got

    try:
        consumer = asyncio.ensure_future(asyncio.to_thread(consume))
        for i in range(n):
            await asyncio.wait_for(tx.send([make_traj(i, i)], rank=0), 10)
        assert await asyncio.wait_for(consumer, 30) == list(range(n))
        assert tx.pending(0) <= credits
    finally:
        rx.close()
        await tx.close()
