"""Hostile messages for the experience channel, at a real producer and a real consumer.

:func:`run` binds a real :class:`ExperienceSender` (the producer, in this process) and
starts a real :class:`ExperienceReceiver` in a child process (``python -m
asyncrl.bench.fuzz_experience consumer``; the receiver, as in a trainer rank), which
connects to the producer and to a bare ROUTER that plays a hostile producer. Then:

- to the consumer, over the hostile ROUTER: malformed messages of every kind in
  :func:`consumer_case` (random frames, truncated or glued headers, missing frames,
  payloads of the wrong size, dtype or shape, negative lengths, other schemas, unknown
  types, messages a producer may not send, elements beyond the known fields, messages
  over the limit, headers over the header caps, a 7.7 MB header listing 1.1 million
  trajectories, batches in a ring never announced), and ``cuts`` frames over the size
  limit, each of which makes libzmq cut the connection (the receiver must reconnect);
- to the producer, over a bare DEALER: the malformed messages of :func:`producer_case`
  and ``cuts`` frames over the limit;
- then a valid batch from each producer, which must arrive bit-exact (crc32 of every
  array), and a report from the consumer, which the producer must receive.

Every malformed message must be counted as rejected by its receiver (counted vs sent;
a frame over the limit is not a reject but a cut), every cut as exactly one reconnect
(consumer) or as seen by the hostile DEALER it cut (producer; the producer's monitor
counts its disconnects too, which may be more than the cuts: closing a cut DEALER, or
its refused reconnection under the old routing id, is one as well), and the consumer's
RSS is read from ``/proc`` before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import random
import select
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from asyncrl.core import ARRAY_FIELDS, Trajectory
from asyncrl.procs import die_with_parent_fn, python_env, stop
from asyncrl.transports.experience.codec import decode, encode, encode_batch, header_limits
from asyncrl.transports.experience.control import StepDone
from asyncrl.transports.experience.curve import curve_client, curve_server
from asyncrl.transports.experience.wire import (
    SCHEMA_VERSION,
    Credit,
    Hello,
    Ring,
    TrainBatch,
    TrajMeta,
)
from asyncrl.transports.experience.zmq_recv import ExperienceReceiver
from asyncrl.transports.experience.zmq_send import ExperienceSender

__all__ = ["consumer_case", "crc", "producer_case", "rss_kb", "run", "traj"]

GOOD_EID = 424_242  # the valid message of the real producer (the consumer then reports)


def traj(eid: int, n_resp: int = 64) -> Trajectory:
    """A trajectory whose content is a function of ``eid``."""
    rng = np.random.default_rng(eid)
    return Trajectory(
        prompt_ids=rng.integers(0, 1 << 30, eid % 13 + 1, dtype=np.int32),
        response_ids=rng.integers(0, 1 << 30, n_resp, dtype=np.int32),
        behav_logprobs=-rng.random(n_resp, dtype=np.float32),
        versions=np.full(n_resp, 3, np.int32),
        loss_mask=(rng.random(n_resp) < 0.8).astype(np.uint8),
        reward=float(eid % 5),
        group_id=eid // 4,
        episode_id=eid,
        metadata={"eid": eid},
    )


def crc(t: Trajectory) -> int:
    """crc32 over every array of ``t`` (compares content across processes)."""
    c = 0
    for name in ARRAY_FIELDS:
        c = zlib.crc32(getattr(t, name), c)
    return c


def rss_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of process ``pid`` in KiB, from ``/proc``."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def _plus(header: bytes, *extra: Any) -> bytes:
    """``header`` with every defaulted field written out, then ``extra`` elements."""
    items = msgspec.msgpack.decode(header)
    defaults = {"batch": [SCHEMA_VERSION, -1, 0]}.get(items[0], [])
    return msgspec.msgpack.encode([*items, *defaults[max(0, len(items) - 4) :], *extra])


LIGHT = (
    "random", "truncated_header", "missing_frame", "payload_size", "wrong_dtype", "lengths",
    "negative_length", "schema", "unknown_type", "forbidden_type", "glued_bytes",
    "extra_element", "extra_in_trajectory", "too_many_trajectories", "ring_not_announced",
)  # fmt: skip
"""Kinds of :func:`consumer_case` drawn at random; the heavy ones (``total_over_limit``,
``header_over_cap``, ``million_trajectories``: up to the limit or 7.7 MB each) are sent a
fixed number of times (``million_trajectories`` only under a limit above its 7.7 MB)."""
HEAVY = ("total_over_limit", "header_over_cap", "million_trajectories")
MILLION_BYTES = 7_700_014  # the header frame of ``million_trajectories``


def consumer_case(
    rng: random.Random, valid: list[bytes], limit: int, kind: str = ""
) -> tuple[str, list[bytes]]:
    """A message of ``kind`` (default: one of :data:`LIGHT`) that a producer could send and
    the consumer must reject: (kind, frames)."""
    head_cap, traj_cap = header_limits(limit)
    kind = kind or rng.choice(LIGHT)
    enc = msgspec.msgpack.encode
    meta = TrajMeta(lengths=(0, 0), reward=0.0, group_id=0, episode_id=0)
    if kind == "random":  # at least one frame: ZeroMQ carries no zero-frame message
        frames = [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 6))]
    elif kind == "truncated_header":
        frames = [valid[0][: rng.randrange(len(valid[0]))], valid[1]]
    elif kind == "missing_frame":
        frames = [valid[rng.randrange(2)]] if rng.random() < 0.5 else [valid[0], b"", b""]
    elif kind == "payload_size":
        cut = valid[1][: rng.randrange(len(valid[1]))]
        frames = [valid[0], cut if rng.random() < 0.5 else valid[1] + rng.randbytes(4)]
    elif kind == "wrong_dtype":  # every value sent as 8 bytes
        frames = [valid[0], np.frombuffer(valid[1], np.uint8).repeat(2).tobytes()]
    elif kind == "lengths":
        bad = TrajMeta(lengths=(rng.randrange(99), rng.randrange(65, 99)), reward=0.0,
                       group_id=0, episode_id=0)  # fmt: skip
        frames = [enc(TrainBatch(seq=0, step=0, trajs=[bad])), valid[1]]
    elif kind == "negative_length":
        bad = TrajMeta(lengths=(-rng.randrange(1, 99), 64), reward=0.0, group_id=0, episode_id=0)
        frames = [enc(TrainBatch(seq=0, step=0, trajs=[bad])), valid[1]]
    elif kind == "schema":
        other = SCHEMA_VERSION + rng.choice([-1, 1, 100])
        frames = [enc(TrainBatch(seq=0, step=0, trajs=[], schema=other)), valid[1]]
    elif kind == "unknown_type":
        frames = [enc([rng.choice(["x", "Batch", "batch2", "hello!"]), 1, 2, []])]
    elif kind == "forbidden_type":  # what only a consumer sends
        wrong: list[Credit | Hello] = [Credit(grant=9), Hello(rank=0, world_size=1, incarnation=1)]
        frames = encode(rng.choice(wrong))
    elif kind == "glued_bytes":
        frames = [valid[0] + rng.randbytes(rng.randrange(1, 8)), valid[1]]
    elif kind == "extra_element":
        frames = [_plus(valid[0], rng.randrange(1 << 20)), valid[1]]
    elif kind == "extra_in_trajectory":
        items = msgspec.msgpack.decode(valid[0])
        entry = [*items[3][0], {}, {}, {}, 0][:8]
        frames = [enc([*items[:3], [entry]]), valid[1]]
    elif kind == "total_over_limit":  # each frame within the limit, together over it
        frames = [valid[0], b"\x00" * (limit // 2 + 1), b"\x00" * (limit // 2 + 1)]
    elif kind == "million_trajectories":  # issue 15: 7.7 MB of header cost 1.2 GB
        frames = [enc(["batch", 0, 0, [[[0, 0], 0, 0, 0]] * 1_100_000]), b""]
    elif kind == "header_over_cap":
        fat = msgspec.structs.replace(meta, metadata={"x": "y" * head_cap})
        frames = [enc(TrainBatch(seq=0, step=0, trajs=[fat])), b""]
    elif kind == "too_many_trajectories":
        frames = [enc(TrainBatch(seq=0, step=0, trajs=[meta] * (traj_cap + 1))), b""]
    else:  # ring_not_announced
        frames = [enc(TrainBatch(seq=0, step=0, trajs=[meta], ring=rng.randrange(1 << 20)))]
    return kind, frames


def producer_case(rng: random.Random, incarnation: int) -> tuple[str, list[bytes]]:
    """One message a consumer could send that the producer must reject: (kind, frames).
    The hostile DEALER has said a valid control Hello as rank 0 of ``incarnation``."""
    enc = msgspec.msgpack.encode
    hello = Hello(rank=0, world_size=1, incarnation=incarnation, control=True)
    kinds = [
        "random", "truncated", "bad_rank", "bad_world", "credit_zero", "schema",
        "extra_element", "unknown_type", "forbidden_type", "glued_bytes", "wrong_field_type",
    ]  # fmt: skip
    kind = rng.choice(kinds)
    if kind == "random":
        frames = [rng.randbytes(rng.randrange(1, 64)) for _ in range(rng.randrange(1, 4))]
    elif kind == "truncated":
        frames = [enc(hello)[: rng.randrange(len(enc(hello)))]]
    elif kind == "bad_rank":
        frames = encode(Hello(rank=rng.choice([-1, 1, 1 << 40]), world_size=1, incarnation=1))
    elif kind == "bad_world":
        frames = encode(Hello(rank=0, world_size=rng.choice([0, 2, 9]), incarnation=1, credit=1))
    elif kind == "credit_zero":  # a data Hello of a new incarnation must grant credit
        frames = encode(Hello(rank=0, world_size=1, incarnation=rng.randrange(1 << 60), credit=0))
    elif kind == "schema":
        frames = [enc(msgspec.structs.replace(hello, schema=SCHEMA_VERSION + 1))]
    elif kind == "extra_element":
        frames = [enc([*msgspec.msgpack.decode(enc(Credit(acked=[1], grant=1))), 0, 1])]
    elif kind == "unknown_type":
        frames = [enc(["credits", [1], 1])]
    elif kind == "forbidden_type":  # what only a producer sends
        ring = Ring(ring=0, name="asyncrl-xp-x", nbytes=4096)
        frames = encode(ring) if rng.random() < 0.5 else [bytes(f) for f in encode_batch(0, 0, [])]
    elif kind == "glued_bytes":
        frames = [enc(Credit(acked=[], grant=1)) + rng.randbytes(rng.randrange(1, 8))]
    else:  # wrong_field_type
        frames = [enc(["credit", "all", "many"])]
    return kind, frames


# -- the driver ----------------------------------------------------------------------------
def _data_hello(router: zmq.Socket, timeout_s: float) -> bytes:
    """Routing id of the consumer's next data Hello on the hostile ROUTER (skips the rest)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if not router.poll(int(left * 1000)):
            break
        ident, *frames = router.recv_multipart()
        try:
            msg, _ = decode(frames)
        except ValueError:
            continue
        if isinstance(msg, Hello) and not msg.control:
            return ident
    raise TimeoutError(f"the fuzz consumer did not say Hello within {timeout_s}s")


def _fuzz_consumer(
    router: zmq.Socket, ident: bytes, rng: random.Random, n: int, heavy: int, cuts: int,
    limit: int,
) -> tuple[Counter[str], bytes]:  # fmt: skip
    """Send ``n`` malformed messages (``heavy`` of each heavy kind, ``cuts`` frames over the
    limit among them) to the consumer's data connection; returns the kinds sent and the
    routing id of its data connection at the end (each cut makes a new one)."""
    valid = [bytes(f) for f in encode_batch(0, 0, [traj(1)])]
    # the 7.7 MB header is one frame: over a smaller limit libzmq cuts on it (a cut, below)
    kinds = [k for k in HEAVY if k != "million_trajectories" or limit > MILLION_BYTES]
    plan = [k for k in kinds for _ in range(heavy)] + ["cut"] * cuts
    plan += [""] * max(0, n - len(plan))
    rng.shuffle(plan)
    over = b"\x00" * (limit + 1)
    sent: Counter[str] = Counter()
    for kind in plan:
        if kind == "cut":
            router.send_multipart([ident, over])
            ident = _data_hello(router, 30.0)  # it reconnected under a new routing id
            sent["cut"] += 1
            continue
        kind, frames = consumer_case(rng, valid, limit, kind)
        router.send_multipart([ident, *frames])
        sent[kind] += 1
    return sent, ident


async def _until(cond: Any, what: Any, timeout_s: float) -> None:
    """Poll ``cond`` until true; TimeoutError with ``what`` (a str, or a callable giving
    one at the timeout: the counts then)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"fuzz: {what() if callable(what) else what} "
                               f"not within {timeout_s}s")  # fmt: skip
        await asyncio.sleep(0.02)


async def _fuzz_producer(
    ctx: zmq.Context, tx: ExperienceSender, rng: random.Random, n: int, cuts: int, limit: int
) -> Counter[str]:
    """Send ``n`` malformed messages (``cuts`` frames over the limit among them) to the
    producer from a DEALER that said a valid control Hello; returns the kinds sent, and as
    ``"cut_seen"`` the cuts that DEALER saw (its own monitor's EVENT_DISCONNECTED: the
    producer read everything sent before the frame, then closed the connection). After
    each cut, a new DEALER (a new routing id: libzmq's ROUTER refuses a reconnection under
    the old one while it still holds the old connection, which would lose what follows).

    Each DEALER is closed only after its own cut was seen: the producer's disconnect count
    is no signal for that (closing the previous DEALER, or its refused reconnection, counts
    there too), and closing earlier would drop what is still queued on it."""
    incarnation = rng.getrandbits(60)
    plan = ["cut"] * cuts + [""] * max(0, n - cuts)
    rng.shuffle(plan)
    over = b"\x00" * (limit + 1)
    sent: Counter[str] = Counter()
    sock, mon = _dealer(ctx, tx.endpoint, incarnation)
    try:
        for kind in plan:
            if kind != "cut":
                kind, frames = producer_case(rng, incarnation)
                sock.send_multipart(frames)
                sent[kind] += 1
                continue
            sock.send(over)
            sent["cut"] += 1
            await _until(lambda m=mon: _cut_seen(m), "the producer cutting the hostile DEALER", 30)
            sent["cut_seen"] += 1
            _close_dealer(sock, mon)
            sock, mon = _dealer(ctx, tx.endpoint, incarnation)
        # closing at once would drop what the last DEALER still queues (linger 0)
        want = sum(sent.values()) - sent["cut"] - sent["cut_seen"]
        await _until(lambda: tx.rejected >= want,
                     lambda: f"the producer's rejects ({tx.rejected} of {want})", 60)  # fmt: skip
    finally:
        _close_dealer(sock, mon)
    return sent


def _dealer(ctx: zmq.Context, endpoint: str, incarnation: int) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER to the producer at ``endpoint`` that said a valid control Hello, and its
    monitor socket (EVENT_DISCONNECTED only)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    curve_client(sock)  # a holder of the run secret: the fuzz is of what comes after
    sock.connect(endpoint)
    hello = Hello(rank=0, world_size=1, incarnation=incarnation, control=True)
    sock.send_multipart(encode(hello))
    return sock, mon


def _cut_seen(mon: zmq.Socket) -> bool:
    """Whether a :func:`_dealer`'s monitor has seen its connection dropped."""
    while mon.poll(0):
        if recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED:
            return True
    return False


def _close_dealer(sock: zmq.Socket, mon: zmq.Socket) -> None:
    sock.disable_monitor()
    mon.close(linger=0)
    sock.close(linger=0)


async def run(
    messages: int, producer_messages: int, cuts: int, heavy: int, limit: int, seed: int
) -> dict[str, Any]:
    """The experience fuzz (see the module docstring); returns its counts."""
    rng = random.Random(seed)
    tx = ExperienceSender(1, "tcp://127.0.0.1:*", max_message_bytes=limit, shm="off")
    ctx = zmq.Context()
    router, port = _router(ctx)
    child = _Child([tx.endpoint, f"tcp://127.0.0.1:{port}"], limit)
    t0 = time.perf_counter()
    try:
        child.expect("ready", 60)
        await tx.wait_peers(60)
        ident = await asyncio.to_thread(_data_hello, router, 60)
        rss0 = rss_kb(child.proc.pid)
        to_consumer, ident = await asyncio.to_thread(
            _fuzz_consumer, router, ident, rng, messages, heavy, cuts, limit
        )
        to_producer = await _fuzz_producer(ctx, tx, rng, producer_messages, cuts, limit)
        cuts_seen = to_producer.pop("cut_seen", 0)
        want_c = sum(to_consumer.values()) - to_consumer["cut"]
        want_p = sum(to_producer.values()) - to_producer["cut"]
        stats = await _child_stats(child, want_c)
        valid_after = await _valid_after(router, ident, tx, child)
        rss1 = rss_kb(child.proc.pid)
        stats = await _child_stats(child, want_c)
        wall = time.perf_counter() - t0
    finally:
        child.send("quit")
        stop([child.proc])
        router.close(linger=0)
        await tx.close()
        ctx.term()
    return {
        "limit_bytes": limit,
        "consumer": {
            "sent": sum(to_consumer.values()), "sent_by_kind": dict(sorted(to_consumer.items())),
            "rejected": stats["rejected"], "rejected_by": stats["rejected_by"],
            "expected_rejects": want_c, "cuts_sent": to_consumer["cut"],
            "reconnects": stats["reconnects"], "rss_before_kb": rss0, "rss_after_kb": rss1,
        },
        "producer": {
            "sent": sum(to_producer.values()), "sent_by_kind": dict(sorted(to_producer.items())),
            "rejected": tx.rejected, "rejected_by": dict(tx._reject.by_kind),
            "expected_rejects": want_p, "cuts_sent": to_producer["cut"],
            "cuts_seen": cuts_seen, "disconnects": tx.counters["disconnects"],
        },
        "valid_after": valid_after,
        "wall_s": wall,
    }  # fmt: skip


def _router(ctx: zmq.Context) -> tuple[zmq.Socket, int]:
    """The ROUTER that plays a data producer to the consumer, and its port."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 0)
    router.setsockopt(zmq.LINGER, 0)
    curve_server(router)  # the consumer speaks CURVE on tcp, as to the run's producer
    return router, router.bind_to_random_port("tcp://127.0.0.1")


async def _valid_after(
    router: zmq.Socket, ident: bytes, tx: ExperienceSender, child: _Child
) -> dict[str, bool]:
    """After the fuzz: a valid message from each producer (the ROUTER as the consumer's
    data producer ``ident``, and ``tx``) arrives bit-exact, and the consumer's report back
    reaches ``tx``."""
    goods = {GOOD_EID: traj(GOOD_EID, 512), GOOD_EID + 1: traj(GOOD_EID + 1, 512)}
    router.send_multipart([ident, *encode_batch(0, 0, [goods[GOOD_EID + 1]])])
    await tx.send([goods[GOOD_EID]], rank=0)
    got: dict[Any, Any] = {}  # eid -> crc, as the child printed them
    while len(got) < 2:
        row = await asyncio.to_thread(child.expect, "eid", 30)
        got[row["eid"]] = row["crc"]
    report = await asyncio.wait_for(tx.recv_report(), 30)
    return {
        "bit_exact": all(got.get(e) == crc(t) for e, t in goods.items()),
        "report_received": isinstance(report, StepDone),
    }


async def _child_stats(child: _Child, want: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """The consumer's counters once it has counted ``want`` rejects (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        child.send("stats")
        stats = await asyncio.to_thread(child.expect, "stats", 30)
        if stats["rejected"] >= want or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.1)


# -- the consumer process ------------------------------------------------------------------
def _consumer(args: argparse.Namespace) -> None:
    """A receiver with the producers' endpoints; JSON lines on stdout: ``{"ready"}``, one per
    delivered trajectory, and ``{"stats"}`` when stdin says ``stats``; exits on ``quit``."""
    rx = ExperienceReceiver(
        args.endpoints.split(","), 0, 1, credits=4, max_message_bytes=args.limit, shm=False
    )

    def say(row: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(row) + "\n")
        sys.stdout.flush()

    say({"ready": True})
    try:
        while True:
            if select.select([sys.stdin], [], [], 0)[0]:
                line = sys.stdin.readline().strip()
                if line in ("quit", ""):
                    return
                say({"stats": True, "rejected": rx.rejected, "rejected_by": rx.rejected_by,
                     "reconnects": rx.reconnects})  # fmt: skip
            d = rx.recv(0.05)
            if d is None or not isinstance(d.msg, TrainBatch):
                continue
            for t in d.trajs:
                say({"eid": t.episode_id, "crc": crc(t), "producer": d.producer})
                if t.episode_id == GOOD_EID:
                    rx.report(StepDone(step=1, version=1))
            rx.ack(d, flush=True)
    finally:
        rx.close()


class _Child:
    """The consumer process: its JSON lines in a queue, commands on its stdin."""

    def __init__(self, endpoints: list[str], limit: int):
        cmd = [sys.executable, "-m", "asyncrl.bench.fuzz_experience", "consumer",
               "--endpoints", ",".join(endpoints), "--limit", str(limit)]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            start_new_session=True, env=python_env(), preexec_fn=die_with_parent_fn(),
        )  # fmt: skip
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def expect(self, key: str, timeout_s: float) -> dict[str, Any]:
        """The next line that has ``key`` (TimeoutError naming the consumer)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                row = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"fuzz consumer (pid {self.proc.pid}): no {key!r} "
                                   f"within {timeout_s}s") from None  # fmt: skip
            if key in row:
                return row

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()


def main(argv: list[str] | None = None) -> None:
    """Entry of the consumer process (``consumer --endpoints A,B --limit BYTES``)."""
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["consumer"])
    p.add_argument("--endpoints", required=True)
    p.add_argument("--limit", type=int, required=True)
    _consumer(p.parse_args(argv))


if __name__ == "__main__":
    main()
