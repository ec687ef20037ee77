"""The weight-sync benchmark's arms: our push, the per-tensor baseline, the floor beside
them, and the row each mode's measurements make (run by ``asyncrl bench weight-sync``).

Contract: :func:`run` starts the engines (``weight_sync_setup``) and measures every
``--modes`` mode into the embedded engines, then (``--engine``) into running SGLang or
vLLM servers: per repeat, in the same run and on the same link, the floor, one checksum
pass, our push (:func:`push_once`: ``total_s`` until every engine acknowledged,
``stall_s`` what the trainer waits) and the naive per-tensor push; then whether every
engine holds the pushed bytes (:func:`verified_sums`). One row a mode: medians and
ratios (the module docstring of ``asyncrl.bench.weight_sync`` defines each column).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from asyncrl.bench import log_dir
from asyncrl.bench.weight_sync_setup import DEVICE, Children, Floor, cpu_s, random_weights

__all__ = ["engine_checksums", "push_once", "run", "verified_sums"]


def _checksum_s(weights: dict[str, Any]) -> float:
    """One checksum pass over every tensor (the read each side's verification makes)."""
    import torch

    from asyncrl.transports.weights.bucket import checksum

    t0 = time.perf_counter()
    for t in weights.values():
        checksum(t)
    if any(t.is_cuda for t in weights.values()):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def push_once(
    sender: Any, weights: dict[str, Any], version: int, train_s: float
) -> dict[str, float]:
    done_at: list[float] = []
    t0 = time.perf_counter()
    handle = sender.push(weights.items(), version)
    push_s = time.perf_counter() - t0
    handle.add_done_callback(lambda _: done_at.append(time.perf_counter()))
    time.sleep(train_s)  # the trainer's next forward/backward
    wait_s = handle.wait_snapshot()  # its optimizer step waits for the sender to read the weights
    stats = handle.wait()
    while not done_at:
        time.sleep(0.001)
    return {"total_s": done_at[0] - t0, "stall_s": push_s + wait_s, "push_s": push_s, **stats}


async def _naive_async(sender: Any, weights: dict[str, Any], version: int) -> None:
    """One control call and one broadcast per tensor, in turn (every engine concurrently)."""
    from asyncrl.transports.weights.seam import BucketAnnouncement

    loop = asyncio.get_running_loop()
    items = list(weights.items())
    for i, (name, t) in enumerate(items):
        last = i == len(items) - 1
        calls = [
            c.update_weights_from_distributed(
                BucketAnnouncement(
                    names=[name],
                    dtypes=[str(t.dtype).removeprefix("torch.")],
                    shapes=[list(t.shape)],
                    group_name=sender.cfg.group_name,
                    flush_cache=last,
                    weight_version=str(version) if last else None,
                )
            )
            for c in sender.engines.clients
        ]
        link = sender._link  # rank 0's end of the formed group
        await asyncio.gather(loop.run_in_executor(None, _broadcast, link, t), *calls)


def _broadcast(link: Any, t: Any) -> None:
    link.finish(link.post(t), t)


def _naive(sender: Any, weights: dict[str, Any], version: int) -> float:
    t0 = time.perf_counter()
    sender.engines.run(_naive_async(sender, weights, version)).result()
    return time.perf_counter() - t0


async def engine_checksums(urls: list[str]) -> list[dict[str, Any]]:
    from asyncrl.engines.rollout.sglang import SGLangClient

    clients = [SGLangClient(u, timeout_s=600) for u in urls]
    try:
        return await asyncio.gather(*(c._call("GET", "/get_weights_checksum") for c in clients))
    finally:
        await asyncio.gather(*(c.close() for c in clients))


def _verified(urls: list[str], weights: dict[str, Any], version: int) -> bool:
    from asyncrl.transports.weights.bucket import checksum

    return verified_sums(urls, {n: checksum(t.contiguous()) for n, t in weights.items()}, version)


def verified_sums(urls: list[str], want: dict[str, int], version: int) -> bool:
    """Every engine holds ``version`` and parameters with the checksums ``want``."""
    states = asyncio.run(engine_checksums(urls))
    return all(s["weight_version"] == str(version) and s["checksums"] == want for s in states)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every row of a full-push run (see the module docstring); its logs in a temporary
    folder."""
    with log_dir("asyncrl-bench-ws-") as logs:
        return _run_logged(args, logs)


def _run_logged(args: argparse.Namespace, logs: Path) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(args.threads)
    me = ["-m", "asyncrl.bench.weight_sync", "--backend", args.backend, "--model", args.model]
    me += ["--dtype", args.dtype, "--repeats", str(args.repeats)]

    me += ["--send-host", args.send_host, "--recv-host", args.recv_host]
    children = Children(args, me, logs)
    engines = [
        children.start("engine", ["--_engine", "--port", "{port}"]) for _ in range(args.engines)
    ]
    urls = [f"http://{args.recv_host}:{e.bench_port}" for e in engines]
    rows = []
    try:
        device = DEVICE[args.backend]
        separate = args.layout == "separate" or args.backend == "cuda-ipc"
        weights = random_weights(args.model, args.dtype, device, separate=separate)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        floor = Floor(args.backend, nbytes, children, args.send_host)
        targets: list[tuple[str, list[str], list[Any]]] = [("embedded", urls, engines)]
        if args.engine != "embedded":  # running servers, measured beside the embedded rows
            targets.append((args.engine, [u for u in args.urls.split(",") if u], []))
        for engine, where, procs in targets:
            for mode in args.modes.split(","):
                rows.append(_measure(args, engine, mode, where, weights, floor, children, procs))
    finally:
        children.stop()
    return rows


class _Runs:
    """One mode's measurements, a list per column, one entry a repeat (``floors``: the
    warm-up's first too)."""

    def __init__(self, floor_s: float):
        self.floors = [floor_s]
        self.ours: list[dict[str, Any]] = []
        self.naive: list[float] = []
        self.sums: list[float] = []
        self.cpu_floor: list[float] = []
        self.cpu_ours: list[float] = []


def _measure(
    args: argparse.Namespace,
    engine: str,
    mode: str,
    urls: list[str],
    weights: dict[str, Any],
    floor: Floor,
    children: Children,
    procs: list[Any],
) -> dict[str, Any]:
    """One row: ``mode``'s pushes of ``weights`` into the ``engine`` family at ``urls``."""
    from asyncrl.bench.weight_sync_engines import verified_by

    runs = _Runs(floor.once())
    sender = _sender(args, engine, mode, urls)
    naive_ok = args.naive and args.backend != "cuda-ipc" and mode == "overlap"
    naive_ok = naive_ok and engine == "embedded"  # SGLang/vLLM: sessions, no per-tensor form
    try:
        sender.connect()
        version = 1
        for _ in range(2):  # warm-up: plans, both receive-buffer sets, connections
            push_once(sender, weights, version, runs.floors[0])
            version += 1
        for _ in range(args.repeats):
            version = _repeat(sender, weights, version, floor, children, procs, runs, naive_ok)
        verified = _verified(urls, weights, version) if engine == "embedded" else None
        verified = verified_by(engine, urls, weights, version, verified)
    finally:
        sender.close()
    return _row(args, engine, mode, len(urls), weights, runs, verified)


def _sender(args: argparse.Namespace, engine: str, mode: str, urls: list[str]) -> Any:
    """The weight sender ``mode`` configures (``--modes``) for the ``engine`` family's
    servers at ``urls``."""
    import msgspec

    from asyncrl.config import WeightSyncConfig
    from asyncrl.engines.rollout.factory import make_weight_transport, rollout_config

    own: dict[str, Any] = (  # the options of this backend's config type
        {"ipc_verify": args.ipc_verify, "ipc_copy": args.ipc_copy}
        if args.backend == "cuda-ipc"
        else {
            "bucket_mb": args.bucket_mb,
            "min_buckets": args.min_buckets,
            "staging_buckets": args.staging_buckets,
            "zero_copy_frac": args.zero_copy_frac,
            "verify": {"unverified": "off", "full-verify": "full"}.get(mode, "sampled"),
        }
    )
    cfg = msgspec.convert(
        {"backend": args.backend, "snapshot": mode == "snapshot", "timeout_s": 600.0,
         "master_address": args.send_host, **own},
        WeightSyncConfig,
    )  # fmt: skip
    rollout = rollout_config("local" if engine == "embedded" else engine)
    return make_weight_transport(cfg, urls, DEVICE[args.backend], rollout.pause_mode, rollout)


def _repeat(
    sender: Any,
    weights: dict[str, Any],
    version: int,
    floor: Floor,
    children: Children,
    procs: list[Any],
    runs: _Runs,
    naive_ok: bool,
) -> int:
    """One timed repeat into ``runs``: the floor, a checksum pass, our push of new bits (and
    the naive push); returns the last version pushed."""
    c0 = cpu_s(*children.local(floor.peer))
    runs.floors.append(floor.once())  # the floor, interleaved with ours
    runs.cpu_floor.append(cpu_s(*children.local(floor.peer)) - c0)
    runs.sums.append(_checksum_s(weights))
    floor_s = statistics.median(runs.floors)
    version += 1
    weights[next(iter(weights))].view(-1)[:1024].random_()  # new bits every version
    c0 = cpu_s(*children.local(*procs))
    runs.ours.append(push_once(sender, weights, version, floor_s))
    runs.cpu_ours.append(cpu_s(*children.local(*procs)) - c0)
    if naive_ok:
        version += 1
        runs.naive.append(_naive(sender, weights, version))
    return version


def _row(
    args: argparse.Namespace,
    engine: str,
    mode: str,
    n_engines: int,
    weights: dict[str, Any],
    runs: _Runs,
    verified: bool | None,
) -> dict[str, Any]:
    """The row of one mode: medians, ratios and the runs themselves."""
    floors, ours, naive = runs.floors, runs.ours, runs.naive
    floor_s = statistics.median(floors)
    total_s = statistics.median(r["total_s"] for r in ours)
    stall_s = statistics.median(r["stall_s"] for r in ours)
    naive_s = statistics.median(naive) if naive else None
    return {
        "engine": engine,
        "backend": args.backend,
        "model": args.model,
        "mode": mode,
        "engines": n_engines,
        "send_host": args.send_host,
        "recv_host": args.recv_host,
        "bytes": sum(t.numel() * t.element_size() for t in weights.values()),
        "num_tensors": len(weights),
        "bucket_mb": args.bucket_mb,
        "min_buckets": args.min_buckets,
        "staging_buckets": args.staging_buckets,
        "zero_copy_frac": args.zero_copy_frac,
        "layout": "separate" if args.layout == "separate" or args.backend == "cuda-ipc" else "flat",
        "floor_s": floor_s,
        "naive_s": naive_s,
        "total_s": total_s,
        "stall_s": stall_s,
        "push_s": statistics.median(r["push_s"] for r in ours),
        "checksum_s": statistics.median(runs.sums),
        "floor_cpu_s": statistics.median(runs.cpu_floor),
        "cpu_s": statistics.median(runs.cpu_ours),
        "verified": verified,
        "total_over_floor": total_s / floor_s,
        "floor_over_total": floor_s / total_s,
        "ipc_verify": args.ipc_verify,
        "ipc_copy": args.ipc_copy,
        "naive_over_total": None if naive_s is None else naive_s / total_s,
        "stall_over_total": stall_s / total_s,
        "floor_runs_s": floors,
        "total_runs_s": [r["total_s"] for r in ours],
        "sender_stats_ms": {  # the sender's own phases (medians), e.g. engine_copy_s
            k: 1e3 * statistics.median(r[k] for r in ours)
            for k in ours[0]
            if k.endswith("_s") and all(k in r for r in ours)
        },
    }
