"""Child processes for the experience-channel tests: a producer and a consumer.

``python tests/transports/experience/peers.py producer ...`` binds an
ExperienceSender, writes its endpoint to ``--endpoint-file`` and streams
trajectories (one per message, ``modulo`` assignment) until all are acked.
``... consumer ...`` connects a receiver, and per message appends a JSON line
``{"eid", "seq", "producer", "group", "crc"}`` to ``--out`` *before* acking it
(``crc``: of every array of the trajectory, see ``crc``). ``... probe ...`` connects
a receiver with the default size limit, waits for the first delivery and writes
``{"eid", "crc", "rejected_by", "rss_before_kb", "rss_after_kb"}`` to ``--out``: its peak
RSS (ru_maxrss) once connected and after the delivery.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from asyncrl.core import ARRAY_FIELDS, Trajectory
from asyncrl.transports.experience.assign import make_assigner
from asyncrl.transports.experience.codec import decode
from asyncrl.transports.experience.control import Shutdown
from asyncrl.transports.experience.wire import Hello
from asyncrl.transports.experience.zmq_recv import ExperienceReceiver
from asyncrl.transports.experience.zmq_send import ExperienceSender


def make_traj(eid: int, group: int, n_resp: int = 16) -> Trajectory:
    """A small trajectory whose content is a function of ``eid``."""
    return Trajectory(
        prompt_ids=np.arange(eid % 7 + 1, dtype=np.int32),
        response_ids=np.full(n_resp, eid % 1000, np.int32),
        behav_logprobs=np.linspace(-1, 0, n_resp, dtype=np.float32),
        versions=np.full(n_resp, 1, np.int32),
        loss_mask=np.ones(n_resp, np.uint8),
        reward=float(eid % 3),
        group_id=group,
        episode_id=eid,
    )


def await_data_hello(router) -> tuple[bytes, Hello]:
    """On a bare ROUTER posing as a producer: identity and Hello of the consumer's data socket."""
    while True:
        assert router.poll(10_000), "no hello"
        ident, frame = router.recv_multipart()
        hello, _ = decode([frame])
        if isinstance(hello, Hello) and not hello.control:
            return ident, hello


def crc(t: Trajectory) -> int:
    """Checksum of every array of ``t`` (to compare content across processes)."""
    c = 0
    for name in ARRAY_FIELDS:
        c = zlib.crc32(getattr(t, name), c)
    return c


async def _produce(args: argparse.Namespace) -> None:
    tx = ExperienceSender(
        args.world, args.bind, peer_timeout_s=30.0, assigner=make_assigner("modulo")
    )
    Path(args.endpoint_file).write_text(tx.endpoint)
    try:
        for g in range(args.groups):
            for k in range(args.per_group):
                eid = args.id * 100_000 + g * 100 + k
                await tx.send_groups([[make_traj(eid, g)]])
        while any(tx.pending(r) for r in range(args.world)):
            await asyncio.sleep(0.05)
    finally:
        await tx.close()


def _consume(args: argparse.Namespace) -> None:
    rx = ExperienceReceiver(
        args.endpoints.split(","), args.rank, args.world, credits=args.credits, heartbeat_s=0.2
    )
    got = 0
    try:
        with open(args.out, "a") as out:
            while args.total <= 0 or got < args.total:
                d = rx.recv(10.0)
                if d is None or isinstance(d.msg, Shutdown):
                    break
                for t in d.trajs:
                    row = {"eid": t.episode_id, "seq": d.msg.seq, "producer": d.producer}
                    out.write(json.dumps({**row, "group": t.group_id, "crc": crc(t)}) + "\n")
                    got += 1
                out.flush()
                time.sleep(args.ack_delay)
                rx.ack(d)
    finally:
        rx.close()


def _probe(args: argparse.Namespace) -> None:
    rx = ExperienceReceiver(args.endpoints.split(","), 0, 1, credits=args.credits)
    try:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        d = rx.recv(60.0)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        (t,) = d.trajs if d is not None else [None]
        row = {"eid": t and t.episode_id, "crc": t and crc(t), "rejected_by": rx.rejected_by}
        row.update(rss_before_kb=before, rss_after_kb=after)
        Path(args.out).write_text(json.dumps(row))
    finally:
        rx.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("producer", "consumer", "probe"))
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--id", type=int, default=0)
    p.add_argument("--bind", default="tcp://127.0.0.1:*")
    p.add_argument("--endpoint-file", default="")
    p.add_argument("--groups", type=int, default=10)
    p.add_argument("--per-group", type=int, default=4)
    p.add_argument("--endpoints", default="")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--credits", type=int, default=4)
    p.add_argument("--out", default="")
    p.add_argument("--total", type=int, default=0)
    p.add_argument("--ack-delay", type=float, default=0.0)
    args = p.parse_args()
    if args.role == "producer":
        asyncio.run(_produce(args))
    elif args.role == "probe":
        _probe(args)
    else:
        _consume(args)


if __name__ == "__main__":
    sys.exit(main())
