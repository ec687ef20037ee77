"""The shared-memory ring fast path: allocator, round trips, wrap-around, bad headers, leaks."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from asyncrl.config import ExperienceConfig
from asyncrl.procs import python_env, spawn, stop
from asyncrl.transports.experience.codec import encode, encode_header, payload_size
from asyncrl.transports.experience.shm import (
    ALIGN,
    SHM_DIR,
    RingReader,
    RingWriter,
    host_token,
    shm_available,
    sweep_orphans,
)
from asyncrl.transports.experience.wire import Ring, TrainBatch, TrajMeta
from asyncrl.transports.experience.zmq_recv import ExperienceReceiver
from asyncrl.transports.experience.zmq_send import ExperienceSender, shm_token
from tests.transports.experience.test_codec import assert_same, traj

sys.path.insert(0, str(Path(__file__).parent))
from peers import await_data_hello, crc, make_traj

pytestmark = pytest.mark.skipif(not shm_available(), reason="needs Linux /dev/shm")
PEERS = str(Path(__file__).with_name("peers.py"))


def _segments(pid: int) -> list[str]:
    """Ring segments (visible or being created) of process ``pid``."""
    return sorted(p.name for p in SHM_DIR.iterdir() if f"asyncrl-xp-{pid}-" in p.name)


def test_allocator_never_overlaps_live_messages_and_wraps_early() -> None:
    ring = RingWriter(64 * ALIGN)
    reader = RingReader(ring.name, ring.nbytes)
    try:
        rng = random.Random(7)
        live: dict[int, tuple[int, int, int]] = {}  # seq -> (offset, size, crc)
        offsets, seq = [], 0
        for _ in range(3000):
            if live and (rng.random() < 0.45 or len(live) > 12):
                s = rng.choice(list(live))  # acks in any order
                off, size, c = live.pop(s)
                assert zlib.crc32(reader.view(off, size)) == c, "a live message was overwritten"
                ring.free(s)
                continue
            traj = make_traj(seq, 0, n_resp=rng.randrange(1, 40))
            size = payload_size([traj])
            off = ring.write(seq, [traj], size)
            if off is not None:
                assert off % ALIGN == 0 and off + size <= ring.nbytes
                for o, sz, _ in live.values():
                    assert off + size <= o or o + sz <= off, "overlap"
                live[seq] = (off, size, crc(traj))
                offsets.append(off)
            else:  # no room now: only while messages are live (each fits an empty ring)
                assert live
            seq += 1
        assert len(offsets) > 1000 and offsets.count(0) > 50  # wraps to 0 early and often
    finally:
        reader.close()
        ring.close()
    assert not (SHM_DIR / ring.name).exists()


@pytest.mark.parametrize("ack_batch", [1, 2])
def test_allocator_has_room_for_the_credit_window_when_acks_come_in_bursts(ack_batch: int) -> None:
    credits, traj = 8, make_traj(0, 0, n_resp=300)
    size = payload_size([traj])
    ring = RingWriter(4 * credits * (size + ALIGN))
    try:
        rng = random.Random(ack_batch)
        live: list[int] = []
        done = 0  # live[:done] are used by the consumer, acked in batches
        for seq in range(3000):
            while done < len(live) and (len(live) >= credits or rng.random() < 0.6):
                done += 1
                if done >= ack_batch:
                    for s in live[:done]:
                        ring.free(s)
                    live, done = live[done:], 0
                if len(live) < credits:
                    break
            assert ring.write(seq, [traj], size) is not None, f"no room at seq {seq}"
            live.append(seq)
        assert ring.used <= ring.nbytes
    finally:
        ring.close()


def test_write_refuses_arrays_that_do_not_match_their_lengths() -> None:
    ring = RingWriter(1 << 16)
    try:
        ok = make_traj(1, 0, n_resp=8)
        bad = make_traj(2, 0, n_resp=8)
        bad.versions = bad.versions.astype(np.int64)  # replaced after construction
        size = payload_size([bad])
        with pytest.raises(TypeError, match="lengths imply"):
            ring.write(0, [ok, bad], payload_size([ok]) + size)
        assert ring.used == 0
        assert ring.write(1, [ok], payload_size([ok])) == 0  # the ring is as it was
    finally:
        ring.close()


async def _recv(rx: ExperienceReceiver, timeout_s: float = 60.0):
    d = await asyncio.to_thread(rx.recv, timeout_s)
    assert d is not None, "nothing received in time"
    return d


async def test_round_trip_every_field_through_the_ring(tmp_path: Path) -> None:
    tx = ExperienceSender(1, f"ipc://{tmp_path}/x.ipc", shm_bytes=1 << 20)
    rx = ExperienceReceiver([tx.endpoint], 0, 1, credits=4, heartbeat_s=0.2)
    try:
        assert tx.uses_shm
        msgs = [
            [traj(10 * m + k, n_prompt=k + 1, n_resp=3 * k) for k in range(4)] for m in range(4)
        ]
        for m in msgs:  # as many as the credits
            await asyncio.wait_for(tx.send(m, rank=0, step=1), 10)
        for m in msgs:
            d = await _recv(rx)
            assert isinstance(d.msg, TrainBatch) and d.msg.ring == 0 and d.msg.step == 1
            for a, b in zip(m, d.trajs, strict=True):
                assert_same(a, b)
                assert not b.response_ids.flags.writeable  # views of the read-only mapping
            rx.ack(d, flush=True)
        assert tx.counters["sent_shm"] == len(msgs) and tx.counters["ring_full"] == 0
        assert rx.rejected == tx.rejected == 0
    finally:
        rx.close()
        await tx.close()
    assert not _segments(os.getpid())


@pytest.mark.parametrize("copy", [False, True])
async def test_arrays_are_valid_until_ack_unless_copied(copy: bool, tmp_path: Path) -> None:
    tx = ExperienceSender(1, f"ipc://{tmp_path}/x.ipc", shm_bytes=1 << 16)
    rx = ExperienceReceiver([tx.endpoint], 0, 1, credits=2, heartbeat_s=0.2, copy=copy)
    try:
        first, second = make_traj(1, 0, n_resp=64), make_traj(2, 0, n_resp=64)
        await tx.send([first], rank=0)
        d1 = await _recv(rx)
        kept = d1.trajs[0]
        np.testing.assert_array_equal(kept.response_ids, first.response_ids)
        rx.ack(d1, flush=True)
        for _ in range(100):  # the producer frees the space once the ack arrives
            if tx.pending(0) == 0:
                break
            await asyncio.sleep(0.02)
        await tx.send([second], rank=0)  # the ring is empty: same offset as the first
        d2 = await _recv(rx)
        assert d2.msg.offset == d1.msg.offset == 0
        want = first if copy else second  # a view after ack shows whatever is there now
        np.testing.assert_array_equal(kept.response_ids, want.response_ids)
    finally:
        rx.close()
        await tx.close()


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def _in_this_task(coro: Any, timeout_s: float) -> Any:
    """``await coro`` in this task, cancelled after ``timeout_s`` (``asyncio.wait_for`` runs it
    in a task of its own: the consumer's ack could land, and pop the pending batch, in the
    loop turn before the caller resumes)."""
    task = asyncio.current_task()
    assert task is not None
    timer = asyncio.get_running_loop().call_later(timeout_s, task.cancel)
    try:
        return await coro
    finally:
        timer.cancel()


async def test_wraparound_with_a_slow_consumer_loses_nothing(tmp_path: Path) -> None:
    credits, n, ring_bytes = 4, 150, 24 << 10
    tx = ExperienceSender(1, f"ipc://{tmp_path}/x.ipc", shm_bytes=ring_bytes)
    out = tmp_path / "rows.jsonl"
    args = [PEERS, "consumer", "--endpoints", tx.endpoint, "--credits", str(credits)]
    child = spawn([*args, "--out", str(out), "--total", str(n), "--ack-delay", "0.002"])
    rng = random.Random(3)
    sent: dict[int, int] = {}
    offsets: list[int] = []
    try:
        for i in range(n):
            t = make_traj(i, i, n_resp=rng.randrange(100, 900))  # 0.9 .. 8 KiB payloads
            sent[i] = crc(t)
            seq = await _in_this_task(tx.send([t], rank=0), 20)  # pending[seq] still there
            assert tx.pending(0) <= credits
            assert tx._peers[0].ring.used <= ring_bytes  # memory bounded by the ring
            batch = msgspec.msgpack.decode(tx._peers[0].pending[seq].frames[0], type=TrainBatch)
            offsets.append(batch.offset if batch.ring >= 0 else -1)
        assert await asyncio.to_thread(child.wait, 60) == 0
        got = {r["eid"]: r["crc"] for r in _rows(out)}
        assert got == sent  # every trajectory, intact
        assert [r["eid"] for r in _rows(out)] == list(range(n))  # in order
        in_ring = [o for o in offsets if o >= 0]
        wraps = sum(b < a for a, b in itertools.pairwise(in_ring))
        assert wraps >= 20 and tx.counters["sent_shm"] == len(in_ring) >= n // 2
        assert tx.counters["sent_shm"] + tx.counters["ring_full"] == n
    finally:
        stop([child])
        await tx.close()


def _bad_ring_messages(ring: RingWriter, valid: TrainBatch) -> list[bytes]:
    """Ring announcements and ring batch headers that must all be rejected as ``shm``."""
    enc = msgspec.msgpack.encode
    rep = msgspec.structs.replace
    want = payload_size([make_traj(7, 3, n_resp=64)])
    big = TrajMeta(lengths=(0, ring.nbytes), reward=0.0, group_id=0, episode_id=0)
    return [
        enc(Ring(ring=5, name="../../etc/passwd", nbytes=4096)),  # not a ring name
        enc(Ring(ring=5, name="asyncrl-xp-1-00000000deadbeef", nbytes=4096)),  # no such segment
        enc(Ring(ring=5, name=ring.name, nbytes=ring.nbytes * 2)),  # larger than the segment
        enc(Ring(ring=5, name=ring.name, nbytes=0)),
        enc(rep(valid, ring=9)),  # a ring never announced
        enc(rep(valid, ring=5)),  # a ring whose announcement was rejected
        enc(rep(valid, offset=ring.nbytes - ALIGN)),  # runs past the end
        enc(rep(valid, offset=ring.nbytes + ALIGN)),  # starts past the end
        enc(rep(valid, offset=-ALIGN)),
        enc(rep(valid, offset=ALIGN + 4)),  # misaligned
        enc(rep(valid, trajs=[big])),  # lengths larger than the ring
        enc(rep(valid, offset=ring.nbytes - want // 2 // ALIGN * ALIGN)),
    ]


def test_bad_ring_headers_are_rejected_and_counted(tmp_path: Path) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{tmp_path}/fake.ipc")
    rx = ExperienceReceiver([f"ipc://{tmp_path}/fake.ipc"], 0, 1, credits=2)
    ring = RingWriter(1 << 16)
    try:
        ident, hello = await_data_hello(router)
        assert hello.shm
        good = make_traj(7, 3, n_resp=64)
        size = payload_size([good])
        off = ring.write(0, [good], size)
        header = encode_header(0, 5, [good], ring=0, offset=off)
        valid = msgspec.msgpack.decode(header, type=TrainBatch)
        router.send_multipart([ident, *encode(Ring(ring=0, name=ring.name, nbytes=ring.nbytes))])
        bad = [[m] for m in _bad_ring_messages(ring, valid)]
        bad.append([header, b"\0" * size])  # a ring batch must not carry a payload frame
        for frames in bad:
            router.send_multipart([ident, *frames])
        router.send_multipart([ident, header])
        d = rx.recv(10.0)
        assert d is not None and isinstance(d.msg, TrainBatch), rx.rejected_by
        assert_same(good, d.trajs[0])
        assert rx.rejected == len(bad), rx.rejected_by
        assert rx.rejected_by == {"shm": len(bad) - 1, "frame_count": 1}
        assert rx.recv(0.1) is None
    finally:
        rx.close()
        router.close(linger=0)
        ctx.term()
        ring.close()


async def test_redelivery_after_a_killed_consumer_maps_the_ring_again(tmp_path: Path) -> None:
    n = 24
    tx = ExperienceSender(1, f"ipc://{tmp_path}/x.ipc", peer_timeout_s=1.5, shm_bytes=1 << 16)
    out1, out2 = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    common = [PEERS, "consumer", "--endpoints", tx.endpoint, "--credits", "4"]
    first = spawn([*common, "--out", str(out1), "--ack-delay", "0.1"], tmp_path / "c1.log")
    second = None
    trajs = [make_traj(i, i, n_resp=200) for i in range(n)]

    async def produce() -> None:
        for t in trajs:
            await tx.send([t], rank=0)

    task = asyncio.create_task(produce())
    try:
        deadline = time.monotonic() + 60
        while len(_rows(out1)) < 4:
            assert time.monotonic() < deadline and first.poll() is None, "consumer did not run"
            await asyncio.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        lost = await asyncio.wait_for(tx.recv_report(), 20)
        assert lost.episode_ids and tx.counters["sent_shm"] == tx.counters["sent"]
        second = spawn([*common, "--out", str(out2), "--total", str(n - tx.counters["acked"])])
        await asyncio.wait_for(task, 60)
        assert await asyncio.to_thread(second.wait, 60) == 0
        rows2 = _rows(out2)
        assert [r["eid"] for r in rows2[: len(lost.episode_ids)]] == lost.episode_ids
        seen = {r["eid"]: r["crc"] for r in [*_rows(out1), *rows2]}
        assert seen == {i: crc(t) for i, t in enumerate(trajs)}  # nothing lost or corrupted
    finally:
        task.cancel()
        stop([p for p in (first, second) if p is not None])
        await tx.close()
    assert not _segments(os.getpid())


async def test_redelivery_to_a_rank_without_rings_goes_as_frames(tmp_path: Path) -> None:
    tx = ExperienceSender(1, f"ipc://{tmp_path}/x.ipc", shm_bytes=1 << 16)
    first = ExperienceReceiver([tx.endpoint], 0, 1, credits=3, heartbeat_s=0.2)
    second = None
    try:
        trajs = [make_traj(i, i, n_resp=100) for i in range(3)]
        for t in trajs:
            await tx.send([t], rank=0)
        assert (await _recv(first)).msg.ring == 0  # received, never acked
        first.close()  # gone with 3 messages unacked, all in the ring
        second = ExperienceReceiver([tx.endpoint], 0, 1, credits=3, shm=False)
        for t in trajs:
            d = await _recv(second)
            assert d.msg.ring == -1 and crc(d.trajs[0]) == crc(t)  # copied out of the ring
            second.ack(d, flush=True)
        for _ in range(100):
            if tx.pending(0) == 0:
                break
            await asyncio.sleep(0.02)
        assert tx.pending(0) == 0 and tx.counters["redelivered"] == 3
        assert tx._peers[0].ring.used == 0
    finally:
        if second is not None:
            second.close()
        await tx.close()


async def test_no_segment_leaks_after_close_or_sigkill(tmp_path: Path) -> None:
    # 1. a SIGKILLed producer: the consumer unlinks its ring when idle (and on close)
    ep = f"ipc://{tmp_path}/p.ipc"
    args = [PEERS, "producer", "--bind", ep, "--endpoint-file", str(tmp_path / "ep")]
    producer = spawn([*args, "--groups", "1000", "--per-group", "1"], tmp_path / "p.log")
    rx = None
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ep").exists():
            assert time.monotonic() < deadline and producer.poll() is None
            await asyncio.sleep(0.05)
        rx = ExperienceReceiver([ep], 0, 1, credits=2, heartbeat_s=0.2)
        d = await _recv(rx)
        assert d.msg.ring == 0 and len(_segments(producer.pid)) == 1
        producer.send_signal(signal.SIGKILL)
        producer.wait(10)
        rx.ack(d, flush=True)
        while _segments(producer.pid):  # the consumer notices within about a second
            assert time.monotonic() < deadline + 10, _segments(producer.pid)
            await asyncio.to_thread(rx.recv, 0.2)
    finally:
        if rx is not None:
            rx.close()
        stop([producer])
    # 2. a SIGKILLed consumer: the producer unlinks its rings on close
    tx = ExperienceSender(1, f"ipc://{tmp_path}/c.ipc")
    consumer = spawn([PEERS, "consumer", "--endpoints", tx.endpoint, "--out", "/dev/null"])
    try:
        await asyncio.wait_for(tx.send([make_traj(0, 0)], rank=0), 30)
        assert len(_segments(os.getpid())) == 1
        consumer.send_signal(signal.SIGKILL)
        consumer.wait(10)
    finally:
        stop([consumer])
        await tx.close()
    assert not _segments(os.getpid())
    # 3. a producer that exits without closing: unlinked at interpreter exit
    code = "from asyncrl.transports.experience.shm import RingWriter; "
    code += "r = RingWriter(4096); print(r.name, flush=True)"
    out = subprocess.run([sys.executable, "-c", code], env=python_env(), capture_output=True)
    assert out.returncode == 0 and out.stdout.strip()
    assert not (SHM_DIR / out.stdout.decode().strip()).exists()
    # 4. both dead: the next producer sweeps the orphan; live rings are left alone
    code = "from asyncrl.transports.experience.shm import RingWriter; import time; "
    code += "r = RingWriter(4096); print(r.name, flush=True); time.sleep(60)"
    orphan = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        env=python_env(),
        start_new_session=True,
    )
    mine = RingWriter(4096)
    try:
        name = orphan.stdout.readline().decode().strip()
        assert (SHM_DIR / name).exists()
        assert name not in sweep_orphans()  # its producer lives
        orphan.send_signal(signal.SIGKILL)
        orphan.wait(10)
        assert name in sweep_orphans() and not (SHM_DIR / name).exists()
        assert (SHM_DIR / mine.name).exists()
    finally:
        stop([orphan])
        mine.close()
    assert not _segments(orphan.pid) and not _segments(os.getpid())


def test_shm_mode_and_config() -> None:
    assert shm_token("auto") == shm_token("on") == host_token() != ""
    assert shm_token("off") == ""
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        shm_token("yes")
    assert ExperienceConfig().shm == "auto" and ExperienceConfig().shm_mb == 64
    with pytest.raises(ValueError, match="shm_mb"):
        ExperienceConfig(shm_mb=0)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"shm": "maybe"}, ExperienceConfig)


async def test_rings_for_same_host_consumers_on_any_endpoint_else_frames(tmp_path: Path) -> None:
    cases = [  # (endpoint, producer shm mode, consumer maps rings, rings used)
        ("tcp://127.0.0.1:*", "auto", True, True),  # loopback tcp: one host, rings
        (f"ipc://{tmp_path}/a.ipc", "off", True, False),
        (f"ipc://{tmp_path}/b.ipc", "auto", False, False),  # e.g. a consumer on another host
    ]
    for ep, mode, maps, rings in cases:
        tx = ExperienceSender(1, ep, shm=mode)
        rx = ExperienceReceiver([tx.endpoint], 0, 1, credits=2, shm=maps)
        try:
            await tx.send([make_traj(3, 1)], rank=0)
            d = await _recv(rx)
            assert (d.msg.ring == 0) == rings and d.trajs[0].episode_id == 3
            assert tx.counters["sent_shm"] == int(rings) and rx.rejected == 0
        finally:
            rx.close()
            await tx.close()
