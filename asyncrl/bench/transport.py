"""Experience transport throughput: our msgspec + ZeroMQ (+ shared-memory ring) channel vs pickle.

``asyncrl bench transport [--json PATH] [--trajectories N] [--group-sizes 8,1] ...``

One producer process (this one) sends trajectories of a 512-token prompt and a
4096-token response (int32 ids, float32 behaviour log-probs, int32 versions,
uint8 loss mask, reward, ids, timings, a small metadata map) to one consumer
process, which decodes every message into ``Trajectory`` objects and acks.

- ours (``msgspec_zmq``, the default channel): ``ExperienceSender`` ->
  ``ExperienceReceiver`` with their defaults (credit flow control, acks). Producer
  and consumer share this host's ``/dev/shm``, so that is the shared-memory ring
  (``experience.shm = "auto"``): the arrays are written once into the ring, ZeroMQ
  carries the header, the consumer gets ``np.frombuffer`` views of the ring.
- ours, frames only (``frames``, ``shm = "off"``, what a consumer on another host
  gets): a header frame + one payload frame through the socket, ``np.frombuffer``
  views of the frame on receipt.
- ``--transport tcp`` only: the same two rows with ZeroMQ CURVE off (``shm_plain``,
  ``frames_plain``): ours runs CURVE (keys from the run secret, asyncrl.secret) on every
  TCP connection, so ``msgspec_zmq`` / ``frames`` vs these rows is what authentication and
  encryption cost, measured side by side in the same run (``curve`` in the JSON).
- baseline: ``pickle.dumps(list_of_trajectories, protocol=5)`` over a PUSH/PULL
  pair, the same trajectories per message, sent with ``copy=True`` (measured: less
  CPU than pyzmq's zero-copy send), received without copying the frame, then
  ``pickle.loads`` (high-water mark = credits on both ends).

Every consumer does the same work per trajectory: it turns each message into
``Trajectory`` objects with numpy arrays (ours then acks; pickle has no acks).
A first message of one group (the connection, warm-up) is sent untimed; then the
``--trajectories`` timed ones, from their first send until the consumer reports it has
everything (the row's ``trajectories`` is that number); each row is the median of
``--repeats`` interleaved runs (the machine may be shared).
Each side's CPU time (all threads, ``time.process_time``) is reported per trajectory,
with the throughput it would allow if each side had a free core (``cpu eps``).
``payload_gbps`` counts the array bytes plus the inline scalars (header frame).

Two nodes (``--transport tcp``): ``--send-host A`` binds the producer on ``A``;
``--recv-host B`` runs the consumer on the Ray node at ``B`` with ``--ray ADDRESS``
(this process on ``A``), else as a local child; the same rows then measure a
cluster's link (the ``msgspec_zmq`` row goes through the ring only where the two
share ``/dev/shm``: its ``channel`` says which).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle  # the baseline this benchmark measures against; never on asyncrl's wire
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from asyncrl.bench import bench_parser
from asyncrl.bench.common import write_json
from asyncrl.core import Trajectory
from asyncrl.procs import spawn, stop
from asyncrl.transports.experience.codec import encode_batch, nbytes
from asyncrl.transports.experience.control import StepDone
from asyncrl.transports.experience.wire import TrainBatch
from asyncrl.transports.experience.zmq_recv import ExperienceReceiver
from asyncrl.transports.experience.zmq_send import ExperienceSender

PROMPT, RESPONSE = 512, 4096


def make_trajectories(n: int, seed: int = 0) -> list[Trajectory]:
    """``n`` distinct trajectories of PROMPT + RESPONSE tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        out.append(
            Trajectory(
                prompt_ids=rng.integers(0, 150_000, PROMPT, dtype=np.int32),
                response_ids=rng.integers(0, 150_000, RESPONSE, dtype=np.int32),
                behav_logprobs=-rng.random(RESPONSE, dtype=np.float32),
                versions=np.full(RESPONSE, 7, np.int32),
                loss_mask=np.ones(RESPONSE, np.uint8),
                reward=float(rng.random()),
                group_id=i // 8,
                episode_id=i,
                timings={"gen_s": 1.5, "reward_s": 0.01},
                metadata={"task": "bench", "turns": 1},
            )
        )
    return out


# -- consumer processes -------------------------------------------------------------------
def _consume_ours(endpoint: str, total: int, credits: int, curve: bool = True) -> None:
    rx = ExperienceReceiver(
        [endpoint], 0, 1, credits=credits, max_message_bytes=1 << 30, curve=curve
    )
    got = 0
    cpu0 = 0.0
    try:
        while got < total:
            d = rx.recv(30.0)
            if d is None:
                raise RuntimeError(f"consumer timed out after {got} trajectories")
            assert isinstance(d.msg, TrainBatch)
            if got == 0:
                cpu0 = time.process_time()  # the first message is not timed
            got += len(d.trajs)
            rx.ack(d, flush=got >= total)
        rx.report(StepDone(step=-1, version=got, metrics={"cpu_s": time.process_time() - cpu0}))
    finally:
        rx.close()


def _consume_pickle(endpoint: str, done_endpoint: str, total: int, credits: int) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, credits)
    pull.connect(endpoint)
    push = ctx.socket(zmq.PUSH)
    push.connect(done_endpoint)
    push.send(b"ready")
    got = 0
    cpu0 = 0.0
    while got < total:
        trajs = pickle.loads(pull.recv(copy=False).buffer)  # no copy of the frame
        assert isinstance(trajs[0], Trajectory)
        if got == 0:
            cpu0 = time.process_time()  # the first message is not timed
        got += len(trajs)
    push.send(f"{got} {time.process_time() - cpu0}".encode())
    push.close(linger=2000)
    pull.close(linger=0)
    ctx.term()


# -- producers (this process) ---------------------------------------------------------------
def _endpoint(args: argparse.Namespace, name: str) -> str:
    return f"ipc://{args.tmp / name}" if args.transport == "ipc" else f"tcp://{args.send_host}:*"


def _start(args: argparse.Namespace, child: list[str]) -> Any:
    """The consumer: a local child, or (``--ray``) a process on the Ray node ``--recv-host``."""
    if not args.ray:
        return spawn(child, die_with_parent=True)  # (from the main thread: see spawn)
    from asyncrl.launchers.ray import NodeProcess

    proc = NodeProcess(args.recv_host, args.tmp)
    proc.start("consumer", child)
    return proc


def _end(proc: Any) -> None:
    if isinstance(proc, subprocess.Popen):
        stop([proc])
    else:  # a Ray NodeProcess
        proc.stop()


async def _run_ours(
    args: argparse.Namespace,
    trajs: list[Trajectory],
    group: int,
    shm: str = "auto",
    curve: bool = True,
) -> tuple[float, float, float]:
    """(wall seconds, producer CPU seconds, consumer CPU seconds) of the timed messages."""
    tx = ExperienceSender(
        1,
        _endpoint(args, f"ours-{shm}.ipc"),
        max_message_bytes=1 << 30,
        shm=shm,
        shm_bytes=args.shm_mb << 20,
        curve=curve,
    )
    assert tx.curve == (curve and args.transport == "tcp")
    child_args = _child_args(args, "ours", tx.endpoint, "", group)
    child = _start(args, child_args if curve else [*child_args, "--no-curve"])
    try:
        msgs = [trajs[i : i + group] for i in range(0, len(trajs), group)]
        await tx.send(msgs[0], rank=0)  # waits for the consumer's hello (not timed)
        t0, c0 = time.perf_counter(), time.process_time()
        for m in msgs[1:]:
            await tx.send(m, rank=0)
        report = await asyncio.wait_for(tx.recv_report(), 120)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert isinstance(report, StepDone) and report.version == len(trajs), report
        args.paths[shm].add("shm" if tx.counters["sent_shm"] == len(msgs) else "frames")
        if 0 < tx.counters["sent_shm"] < len(msgs):
            args.paths[shm].add(f"{tx.counters['ring_full']} of {len(msgs)} as frames")
        return dt, cpu, report.metrics["cpu_s"]
    finally:
        await tx.close()
        _end(child)


async def _run_pickle(
    args: argparse.Namespace, trajs: list[Trajectory], group: int
) -> tuple[float, float, float]:
    """(wall seconds, producer CPU seconds, consumer CPU seconds) of the timed messages."""
    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, args.credits)
    push.bind(_endpoint(args, "pickle.ipc"))
    done = ctx.socket(zmq.PULL)
    done.bind(_endpoint(args, "done.ipc"))
    ep, done_ep = (s.getsockopt_string(zmq.LAST_ENDPOINT) for s in (push, done))
    child = _start(args, _child_args(args, "pickle", ep, done_ep, group))
    try:
        msgs = [trajs[i : i + group] for i in range(0, len(trajs), group)]
        assert await asyncio.wait_for(done.recv(), 60) == b"ready"
        await push.send(pickle.dumps(msgs[0], protocol=pickle.HIGHEST_PROTOCOL))
        t0, c0 = time.perf_counter(), time.process_time()
        for m in msgs[1:]:  # copy=True: less CPU than a zero-copy send here (measured)
            await push.send(pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL))
        got, rx_cpu = (await asyncio.wait_for(done.recv(), 120)).split()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert int(got) == len(trajs), got
        return dt, cpu, float(rx_cpu)
    finally:
        _end(child)
        push.close(linger=0)
        done.close(linger=0)
        ctx.term()


def _child_args(
    args: argparse.Namespace, role: str, ep: str, done_ep: str, group: int
) -> list[str]:
    return [
        "-m", "asyncrl.bench.transport",
        "--role", role,
        "--endpoint", ep,
        "--done-endpoint", done_ep,
        "--total", str(args.trajectories + group),  # + the first message, not timed
        "--credits", str(args.credits),
    ]  # fmt: skip


async def _bench(args: argparse.Namespace) -> list[dict]:
    pool = make_trajectories(64)
    rows = []
    for group in args.group_sizes:
        timed = args.trajectories  # after a first message of `group` more, not timed
        trajs = [pool[i % len(pool)] for i in range(timed + group)]
        per_traj = nbytes(encode_batch(0, -1, trajs[:group])) / group
        res: dict[str, list[tuple[float, float, float]]] = {"msgspec_zmq": [], "pickle_zmq": []}
        res["frames"] = []
        plain = args.transport == "tcp"  # CURVE runs on TCP only: its cost, same run
        if plain:
            res["shm_plain"], res["frames_plain"] = [], []
        for _ in range(args.repeats):  # interleaved, so all see the same machine load
            res["msgspec_zmq"].append(await _run_ours(args, trajs, group))
            res["frames"].append(await _run_ours(args, trajs, group, shm="off"))
            if plain:
                res["shm_plain"].append(await _run_ours(args, trajs, group, curve=False))
                res["frames_plain"].append(
                    await _run_ours(args, trajs, group, shm="off", curve=False)
                )
            res["pickle_zmq"].append(await _run_pickle(args, trajs, group))
        for impl, triples in res.items():
            runs = [r[0] for r in triples]
            tx_cpu = statistics.median(r[1] for r in triples)
            rx_cpu = statistics.median(r[2] for r in triples)
            dt = statistics.median(runs)
            rows.append(
                {
                    "impl": impl,
                    "group_size": group,
                    "trajectories": timed,
                    "seconds": dt,
                    "eps": timed / dt,
                    "gbps": timed * per_traj / dt / 1e9,
                    "eps_runs": [timed / r for r in runs],
                    "best_eps": timed / min(runs),
                    "best_gbps": timed * per_traj / min(runs) / 1e9,
                    "producer_cpu_us_per_traj": tx_cpu / timed * 1e6,
                    "consumer_cpu_us_per_traj": rx_cpu / timed * 1e6,
                    # throughput if each side had a core of its own: the busier side bounds it
                    "cpu_bound_eps": timed / max(tx_cpu, rx_cpu),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = _parser()
    args = p.parse_args(argv)
    if args.role == "ours":
        return _consume_ours(args.endpoint, args.total, args.credits, not args.no_curve)
    if args.role == "pickle":
        return _consume_pickle(args.endpoint, args.done_endpoint, args.total, args.credits)
    _check(p, args)
    import tempfile

    if args.ray:
        import ray

        ray.init(address=args.ray, _node_ip_address=args.send_host, log_to_driver=False)
    args.paths = {"auto": set(), "off": set()}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="xport-") as tmp:
        args.tmp = Path(tmp)
        rows = asyncio.run(_bench(args))
    load = (load_before + os.getloadavg()[0]) / 2
    _print(rows, args)
    print(f"machine: {os.cpu_count()} CPUs, 1-min load average during the run ~{load:.1f}")
    result = _result(rows, args, load)
    _print_headline(result)
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")


def _parser() -> argparse.ArgumentParser:
    p = bench_parser("transport", __doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.add_argument(
        "--trajectories",
        type=int,
        default=16000,
        help="timed trajectories per run (a multiple of every group size)",
    )
    p.add_argument("--group-sizes", default="8,1", help="trajectories per message, comma list")
    p.add_argument("--credits", type=int, default=16, help="credits (ours) = HWM (pickle)")
    p.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    p.add_argument("--shm-mb", type=int, default=64, help="ring size per rank (ours)")
    p.add_argument("--repeats", type=int, default=5, help="runs per row; the median is shown")
    p.add_argument("--send-host", default="127.0.0.1", help="tcp: the producer's address")
    p.add_argument("--recv-host", default="127.0.0.1", help="tcp: the consumer's node")
    p.add_argument("--ray", default="", help="Ray cluster address: consumer on --recv-host")
    p.add_argument("--role", choices=("ours", "pickle"), help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--done-endpoint", help=argparse.SUPPRESS)
    p.add_argument("--total", type=int, help=argparse.SUPPRESS)
    p.add_argument("--no-curve", action="store_true", help=argparse.SUPPRESS)
    return p


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Parses ``--group-sizes`` into ints; ``p.error`` on sizes or hosts that cannot run."""
    args.group_sizes = [int(g) for g in args.group_sizes.split(",")]
    if args.trajectories < 1 or any(g < 1 or args.trajectories % g for g in args.group_sizes):
        p.error(
            f"--trajectories {args.trajectories} must be a positive multiple of every group "
            f"size ({args.group_sizes}): that many are timed, after one untimed message"
        )
    if args.transport == "ipc" and (
        args.ray or "127.0.0.1" not in (args.send_host, args.recv_host)
    ):
        p.error("--send-host/--recv-host/--ray need --transport tcp")


def _result(rows: list[dict], args: argparse.Namespace, load: float) -> dict[str, Any]:
    """The JSON result: the first group size's headline over every run's ``rows``."""
    first = {r["impl"]: r for r in rows if r["group_size"] == args.group_sizes[0]}
    head, base = first["msgspec_zmq"], first["pickle_zmq"]
    channel = ", ".join(sorted(args.paths["auto"]))
    result = {
        "msgspec_zmq_eps": head["eps"],
        "channel": channel,  # the path that produced msgspec_zmq_eps: shm or frames
        "pickle_baseline_eps": base["eps"],
        "speedup": head["eps"] / base["eps"],
        "cpu_bound_speedup": head["cpu_bound_eps"] / base["cpu_bound_eps"],
        "payload_gbps": head["gbps"],
        "group_size": args.group_sizes[0],
        "transport": args.transport,
        "send_host": args.send_host,
        "recv_host": args.recv_host,
        "credits": args.credits,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "load_avg_1m": load,
        "prompt_tokens": PROMPT,
        "response_tokens": RESPONSE,
        "runs": rows,
    }
    frames = first["frames"]
    result.update(
        frames_eps=frames["eps"],
        frames_speedup=frames["eps"] / base["eps"],
        frames_payload_gbps=frames["gbps"],
    )
    if "frames_plain" in first:  # tcp: what CURVE costs, same run
        result["curve"] = _curve_cost(first)
    return result


def _print_headline(result: dict[str, Any]) -> None:
    """CURVE's cost (tcp runs) and the headline line, from :func:`_result`'s ``result``."""
    if "curve" in result:
        c = result["curve"]
        print(
            f"CURVE on vs off over tcp: frames {c['frames_eps_on']:.0f} vs "
            f"{c['frames_eps_off']:.0f} eps ({c['frames_gbps_on']:.2f} vs "
            f"{c['frames_gbps_off']:.2f} GB/s, x{c['frames_ratio']:.2f}); shm ring "
            f"{c['shm_eps_on']:.0f} vs {c['shm_eps_off']:.0f} eps (x{c['shm_ratio']:.2f})"
        )
    print(
        f"\nheadline (group {result['group_size']}): ours ({result['channel']}) "
        f"{result['msgspec_zmq_eps']:.0f} eps, pickle {result['pickle_baseline_eps']:.0f} eps, "
        f"x{result['speedup']:.2f}, payload {result['payload_gbps']:.2f} GB/s"
        + f"; frames only {result['frames_eps']:.0f} eps (x{result['frames_speedup']:.2f})"
    )


def _curve_cost(first: dict[str, dict]) -> dict[str, float]:
    """CURVE on (``frames``, ``msgspec_zmq``) vs off (``*_plain``): eps, GB/s, on/off ratio."""
    out: dict[str, float] = {}
    for name, on, off in (
        ("frames", "frames", "frames_plain"),
        ("shm", "msgspec_zmq", "shm_plain"),
    ):
        out[f"{name}_eps_on"], out[f"{name}_eps_off"] = first[on]["eps"], first[off]["eps"]
        out[f"{name}_gbps_on"], out[f"{name}_gbps_off"] = first[on]["gbps"], first[off]["gbps"]
        out[f"{name}_ratio"] = first[on]["eps"] / first[off]["eps"]
    return out


def _print(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"experience transport, {PROMPT}+{RESPONSE} tokens/trajectory, {args.transport}, "
        f"credits/HWM {args.credits}; msgspec_zmq = ours, default channel "
        f"({', '.join(sorted(args.paths['auto']))}); frames = ours with shm off"
        + ("; *_plain = the same with CURVE off" if args.transport == "tcp" else "")
    )
    print(
        f"{'impl':<12} {'group':>5} {'traj':>6} {'seconds':>8} {'eps':>9} {'GB/s':>6} "
        f"{'best eps':>9} {'best GB/s':>9} {'tx us/t':>8} {'rx us/t':>8} {'cpu eps':>8}"
    )
    for r in rows:
        print(
            f"{r['impl']:<12} {r['group_size']:>5} {r['trajectories']:>6} {r['seconds']:>8.2f} "
            f"{r['eps']:>9.0f} {r['gbps']:>6.2f} {r['best_eps']:>9.0f} {r['best_gbps']:>9.2f} "
            f"{r['producer_cpu_us_per_traj']:>8.1f} {r['consumer_cpu_us_per_traj']:>8.1f} "
            f"{r['cpu_bound_eps']:>8.0f}"
        )
    print(
        "(seconds, eps, GB/s: median of the repeats; best: the fastest repeat; tx/rx us/t: "
        "producer/consumer CPU time per trajectory, all threads; cpu eps: trajectories/s "
        "the busier side's CPU time allows, i.e. with a free core per side)"
    )


if __name__ == "__main__":
    main()
