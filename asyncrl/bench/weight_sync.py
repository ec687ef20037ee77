"""Weight-sync benchmark: our bucketed stream vs. the link's floor and per-tensor broadcasts.

``asyncrl bench weight-sync --backend gloo|nccl|hccl|cuda-ipc [--model qwen2-0.5b|qwen2-1.5b]
[--engines N] [--engine sglang|vllm --urls URL[,URL]] [--json PATH]`` (``--delta``: delta
pushes, ``weight_sync_delta``; ``--lora``: adapter-only pushes vs the full push,
``weight_sync_lora``; ``--engine``: the same pushes into running SGLang or vLLM servers too,
rows beside the embedded engine's, ``weight_sync_engines``)

The model's shapes come from a local ``Qwen2Config`` (no download); the sender's
tensors hold random bits. Every engine is a real separate process (the embedded
engine's HTTP server with that model, uninitialised) joined over the transport.
Per repeat, in the same run and on the same link:

- ``floor_s``: one flat broadcast of the same bytes to a peer process (for
  ``cuda-ipc``: one device-to-device copy of the same bytes);
- ``total_s``: ``push`` until every engine verified, switched and acknowledged;
- ``stall_s``: the ``push`` call plus the wait before the next optimizer step,
  with a simulated train step (a sleep as long as ``floor_s``) in between;
- ``naive_s``: one control call + one broadcast per tensor (older RL stacks);
- ``verified``: every engine parameter's checksum equals the sender's;
- ``checksum_s``: one checksum pass over the same bytes in this process (what
  each side's verification of a push reads; with ``weights.verify`` on, the
  sender and every engine each make one such pass);
- ``floor_cpu_s`` / ``cpu_s``: CPU seconds (user + system, all threads) that the
  floor (this process + its peer) and our push (this process + the engines)
  used, from ``/proc`` (Linux): the profile of what a push costs beyond the link.

For ``cuda-ipc`` the sender's tensors are separate CUDA allocations (as a
trainer's parameters are: the engine maps and copies each one), and the bench
also prints the sender's phases (medians, ms; ``engine_*`` as the engine
reported them). ``--ipc-copy`` and ``--ipc-verify`` set ``weights.ipc_copy`` /
``weights.ipc_verify``.

Reported figures are medians over ``--repeats`` after two warm-up pushes.

Two nodes: ``--send-host A --recv-host B`` bind the sender (this process: the
weight-sync master, the floor's rank 0) to ``A`` and the engines and the floor's
peer to ``B``; with ``--ray ADDRESS`` those receiving processes run on the Ray
node whose address is ``B`` (this process on ``A``), so the same columns measure a
cluster's own link. CPU columns then count this process only where the
receivers are on another node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.bench import bench_parser, log_dir
from asyncrl.bench.common import qwen2, write_json

MODELS: dict[str, dict[str, Any]] = {  # Qwen2Config keyword arguments
    "tiny": qwen2(64, 128, 2, 4, 2, 1024, tie_word_embeddings=True),  # a smoke run, unmeasured
    "qwen2-0.5b": qwen2(896, 4864, 24, 14, 2, 151936, tie_word_embeddings=True),
    "qwen2-1.5b": qwen2(1536, 8960, 28, 12, 2, 151936, tie_word_embeddings=True),
}
DEVICE = {"gloo": "cpu", "nccl": "cuda", "hccl": "npu", "cuda-ipc": "cuda"}


def _shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        m = Qwen2ForCausalLM(Qwen2Config(**MODELS[model]))
    return [(n, tuple(p.shape)) for n, p in m.named_parameters()]


# -- child processes ------------------------------------------------------------------
def _serve_engine(args: argparse.Namespace) -> None:
    """A real engine process: the embedded server around the model's shapes (uninitialised)."""
    import torch
    from aiohttp import web
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl import secret
    from asyncrl.engines.rollout.local.engine import LocalEngine
    from asyncrl.engines.rollout.local.server import EngineServer, build_app
    from asyncrl.loops import new_event_loop

    torch.set_num_threads(1)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**MODELS[args.model], dtype=args.dtype))
    device = DEVICE[args.backend]
    model = model.to_empty(device=device).to(getattr(torch, args.dtype))
    model.tie_weights()  # to_empty unties: the served model must have the sender's parameters
    engine = LocalEngine(model, {0}, device=device)
    if args.lora_rank:  # --lora: adapters of this rank on the default targets, a ring of 2
        from asyncrl.config import LoraConfig
        from asyncrl.engines.rollout.local.lora import LoraSpec

        targets = LoraConfig().target_modules
        engine.enable_lora(LoraSpec(args.lora_rank, 16.0, targets, 2))
    masters = f"loopback,{args.send_host}"  # the sender: this host, or --send-host's node
    server = EngineServer(engine, f"{args.model}-shapes", args.recv_host, masters)
    app = build_app(server, secret.load())
    loop = new_event_loop()  # as the engine server's main does
    web.run_app(app, host=args.recv_host, port=args.port, print=None, access_log=None, loop=loop)


def _floor_peer(args: argparse.Namespace) -> None:
    """Receiving side of the floor: ``repeats + 1`` flat broadcasts of ``nbytes``."""
    import torch

    from asyncrl.transports.weights.collective_wire import broadcast, new_weight_group

    torch.set_num_threads(1)
    group = new_weight_group(
        args.backend, args.send_host, args.port, 1, 2, "floor", 120.0, args.recv_host
    )
    buf = torch.empty(args.nbytes, dtype=torch.uint8, device=DEVICE[args.backend])
    while True:  # until the benchmark stops this process
        broadcast(group, buf)


# -- measurements ---------------------------------------------------------------------
def _weights(model: str, dtype: str, device: str, separate: bool = False) -> dict[str, Any]:
    """Random bits in the model's shapes: views of one flat tensor, or (``separate``) one
    allocation per tensor, like a trainer's parameters (what cuda-ipc must map)."""
    import torch

    shapes = _shapes(model)
    total = sum(torch.Size(s).numel() for _, s in shapes)
    period = (1 << 24) + 7  # random bits, repeated with a period that no tensor size shares
    base = torch.empty(period, dtype=torch.int16).random_(-(1 << 15), (1 << 15) - 1)
    words = total * getattr(torch, dtype).itemsize // 2  # int16 words of random bits
    flat = base.repeat(-(-words // period))[:words].clone()
    flat = flat.view(getattr(torch, dtype)).to(device)
    out, off = {}, 0
    for name, shape in shapes:
        n = torch.Size(shape).numel()
        out[name] = flat[off : off + n].view(shape)
        if separate:
            out[name] = out[name].clone()
        off += n
    return out


class _Floor:
    """One flat transfer of ``nbytes`` on the same link: a broadcast to a peer process
    (for ``cuda-ipc``: a device-to-device copy), measured between our pushes."""

    def __init__(
        self, backend: str, nbytes: int, children: _Children, send_host: str, buf: Any = None
    ):
        """``buf``: the bytes to send (flat uint8 of ``nbytes``, e.g. the weights' own), else
        random ones."""
        import torch

        from asyncrl.procs import free_port
        from asyncrl.transports.weights.collective_wire import new_weight_group

        self.backend, self.peer, self.group = backend, None, None
        # Real bytes: a never-written buffer reads as the kernel's shared zero page (always
        # in cache), which would make the floor faster than any transfer of real weights.
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE[backend]).random_(0, 256)
        self.buf = buf
        if backend == "cuda-ipc":
            self.dst = torch.empty_like(self.buf)
            return
        port = free_port(send_host)  # the peer joins our store, on our address
        self.peer = children.start(
            "peer", ["--_peer", "--port", str(port), "--nbytes", str(nbytes)]
        )
        self.group = new_weight_group(backend, send_host, port, 0, 2, "floor", 120.0, send_host)
        self.once()  # warm-up

    def once(self) -> float:
        import torch

        from asyncrl.transports.weights.collective_wire import broadcast

        if self.group is None:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.dst.copy_(self.buf)
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        t0 = time.perf_counter()
        broadcast(self.group, self.buf)
        return time.perf_counter() - t0


class _Children:
    """The receiving side's processes: children of this process on ``--recv-host``, or
    (``--ray``) processes in Ray actors on the Ray node at ``--recv-host``."""

    def __init__(self, args: argparse.Namespace, me: list[str], logs: Path):
        netns = getattr(args, "netns", "")
        self.args, self.me, self.logs = args, [*me, *(["--_netns", netns] if netns else [])], logs
        self.procs: list[Any] = []
        if args.ray:
            import ray

            ray.init(address=args.ray, _node_ip_address=args.send_host, log_to_driver=False)

    def start(self, name: str, extra: list[str], port: int = 0) -> Any:
        """Start ``extra`` (``{port}`` in it: a port free on the receiving node)."""
        from asyncrl.forkserver import spawn_shared
        from asyncrl.procs import free_port, python_env

        proc: Any  # a NodeProcess or a Popen, tagged with the port it serves on
        if self.args.ray:
            from asyncrl.launchers.ray import NodeProcess

            proc = NodeProcess(self.args.recv_host, self.logs)
            port = proc.free_port()
            proc.start(f"{name}-{len(self.procs)}", [*self.me, *_fill(extra, port)])
        else:
            # in an emulated link's namespace nothing else listens: any port free here will do
            port = free_port(
                "127.0.0.1" if getattr(self.args, "netns", "") else self.args.recv_host
            )
            log = self.logs / f"{name}-{len(self.procs)}.log"
            cmd = [*self.me, *_fill(extra, port)]
            proc = spawn_shared(cmd, log, python_env(), die_with_parent=True)
        self.procs.append(proc)
        proc.bench_port = port
        return proc

    def local(self, *procs: Any) -> list[Any]:
        """The ones whose pid means something in this /proc (for the CPU columns)."""
        from asyncrl.forkserver import Forked

        return [p for p in procs if isinstance(p, (subprocess.Popen, Forked))]

    def stop(self) -> None:
        from asyncrl.procs import stop

        local = self.local(*self.procs)
        stop(local)
        for p in self.procs:
            if p not in local:  # a Ray NodeProcess
                p.stop()
        if self.args.ray:
            import ray

            ray.shutdown()


def _fill(extra: list[str], port: int) -> list[str]:
    return [a.replace("{port}", str(port)) for a in extra]


def _cpu_s(*children: Any) -> float:
    """CPU seconds (user + system) used so far by this process and ``children`` (Linux /proc)."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    total = own.ru_utime + own.ru_stime
    for child in children:
        if child is None:
            continue
        try:
            with open(f"/proc/{child.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


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


def _ours(sender: Any, weights: dict[str, Any], version: int, train_s: float) -> dict[str, float]:
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


async def _engine_checksums(urls: list[str]) -> list[dict[str, Any]]:
    from asyncrl.engines.rollout.sglang import SGLangClient

    clients = [SGLangClient(u, timeout_s=600) for u in urls]
    try:
        return await asyncio.gather(*(c._call("GET", "/get_weights_checksum") for c in clients))
    finally:
        await asyncio.gather(*(c.close() for c in clients))


def _verified(urls: list[str], weights: dict[str, Any], version: int) -> bool:
    from asyncrl.transports.weights.bucket import checksum

    return _verified_sums(urls, {n: checksum(t.contiguous()) for n, t in weights.items()}, version)


def _verified_sums(urls: list[str], want: dict[str, int], version: int) -> bool:
    """Every engine holds ``version`` and parameters with the checksums ``want``."""
    states = asyncio.run(_engine_checksums(urls))
    return all(s["weight_version"] == str(version) and s["checksums"] == want for s in states)


def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    with log_dir("asyncrl-bench-ws-") as logs:
        return _run_logged(args, logs)


def _run_logged(args: argparse.Namespace, logs: Path) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(args.threads)
    me = ["-m", "asyncrl.bench.weight_sync", "--backend", args.backend, "--model", args.model]
    me += ["--dtype", args.dtype, "--repeats", str(args.repeats)]

    me += ["--send-host", args.send_host, "--recv-host", args.recv_host]
    children = _Children(args, me, logs)
    engines = [
        children.start("engine", ["--_engine", "--port", "{port}"]) for _ in range(args.engines)
    ]
    urls = [f"http://{args.recv_host}:{e.bench_port}" for e in engines]
    rows = []
    try:
        device = DEVICE[args.backend]
        separate = args.layout == "separate" or args.backend == "cuda-ipc"
        weights = _weights(args.model, args.dtype, device, separate=separate)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        floor = _Floor(args.backend, nbytes, children, args.send_host)
        targets: list[tuple[str, list[str], list[Any]]] = [("embedded", urls, engines)]
        if args.engine != "embedded":  # running servers, measured beside the embedded rows
            targets.append((args.engine, [u for u in args.urls.split(",") if u], []))
        for engine, where, procs in targets:
            for mode in args.modes.split(","):
                rows.append(_measure(args, engine, mode, where, weights, floor, children, procs))
    finally:
        children.stop()
    return rows


def _measure(
    args: argparse.Namespace,
    engine: str,
    mode: str,
    urls: list[str],
    weights: dict[str, Any],
    floor: _Floor,
    children: _Children,
    procs: list[Any],
) -> dict[str, Any]:
    """One row: ``mode``'s pushes of ``weights`` into the ``engine`` family at ``urls``."""
    import msgspec

    from asyncrl.bench.weight_sync_engines import verified_by
    from asyncrl.config import WeightSyncConfig
    from asyncrl.engines.rollout.factory import make_weight_transport, rollout_config

    device = DEVICE[args.backend]
    floors = [floor.once()]
    floor_s = floors[0]
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
    sender = make_weight_transport(cfg, urls, device, rollout.pause_mode, rollout)
    naive_ok = args.naive and args.backend != "cuda-ipc" and mode == "overlap"
    naive_ok = naive_ok and engine == "embedded"  # SGLang/vLLM: sessions, no per-tensor form
    try:
        sender.connect()
        version = 1
        for _ in range(2):  # warm-up: plans, both receive-buffer sets, connections
            _ours(sender, weights, version, floor_s)
            version += 1
        ours, naive, cpu_floor, cpu_ours, sums = [], [], [], [], []
        for _ in range(args.repeats):
            c0 = _cpu_s(*children.local(floor.peer))
            floors.append(floor.once())  # the floor, interleaved with ours
            cpu_floor.append(_cpu_s(*children.local(floor.peer)) - c0)
            sums.append(_checksum_s(weights))
            floor_s = statistics.median(floors)
            version += 1
            weights[next(iter(weights))].view(-1)[:1024].random_()  # new bits every version
            c0 = _cpu_s(*children.local(*procs))
            ours.append(_ours(sender, weights, version, floor_s))
            cpu_ours.append(_cpu_s(*children.local(*procs)) - c0)
            if naive_ok:
                version += 1
                naive.append(_naive(sender, weights, version))
        verified = _verified(urls, weights, version) if engine == "embedded" else None
        verified = verified_by(engine, urls, weights, version, verified)
    finally:
        sender.close()
    return _row(args, engine, mode, len(urls), weights, floors, ours, naive, sums,
                cpu_floor, cpu_ours, verified)  # fmt: skip


def _row(
    args: argparse.Namespace,
    engine: str,
    mode: str,
    n_engines: int,
    weights: dict[str, Any],
    floors: list[float],
    ours: list[dict[str, Any]],
    naive: list[float],
    sums: list[float],
    cpu_floor: list[float],
    cpu_ours: list[float],
    verified: bool | None,
) -> dict[str, Any]:
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
        "checksum_s": statistics.median(sums),
        "floor_cpu_s": statistics.median(cpu_floor),
        "cpu_s": statistics.median(cpu_ours),
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


def _table(rows: list[dict[str, Any]]) -> str:
    cols = [
        "engine",
        "backend",
        "mode",
        "bytes",
        "num_tensors",
        "floor_s",
        "naive_s",
        "total_s",
        "stall_s",
    ]
    cols += [
        "total_over_floor",
        "floor_over_total",
        "naive_over_total",
        "stall_over_total",
        "verified",
    ]
    cols += ["checksum_s", "floor_cpu_s", "cpu_s"]
    fmt = lambda v: f"{v:.5f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = [" | ".join(cols)]
    lines += [" | ".join(fmt(r[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("weight-sync", "asyncrl weight-sync benchmark")
    p.add_argument("--backend", default="gloo", choices=sorted(DEVICE))
    p.add_argument("--model", default="qwen2-0.5b", choices=sorted(MODELS))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--engines", type=int, default=1, help="embedded engine processes")
    p.add_argument(
        "--engine",
        default="embedded",
        choices=["embedded", "sglang", "vllm"],
        help="also push into running SGLang / vLLM servers (--urls) holding a model of "
        "--model's shapes, rows beside the embedded engine's (docs/results/weight-sync.md)",
    )
    p.add_argument("--urls", default="", help="--engine sglang|vllm: the servers, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="timed pushes (median reported)")
    p.add_argument("--bucket-mb", type=int, default=512, help="weights.bucket_mb")
    p.add_argument("--min-buckets", type=int, default=8, help="weights.min_buckets")
    p.add_argument("--staging-buckets", type=int, default=0, help="weights.staging_buckets")
    p.add_argument(
        "--layout",
        default="flat",
        choices=["flat", "separate"],
        help="the sender's tensors: views of one buffer (a trainer with flat parameters) or "
        "one allocation each (FSDP2's parameters; always for cuda-ipc)",
    )
    p.add_argument("--zero-copy-frac", type=float, default=0.75, help="weights.zero_copy_frac")
    p.add_argument(
        "--modes",
        default="overlap,full-verify,unverified,snapshot",
        help="overlap (the default config: weights.verify=sampled), full-verify (overlap with "
        "weights.verify=full), unverified (weights.verify=off), snapshot (weights.snapshot=true)",
    )
    p.add_argument("--no-naive", dest="naive", action="store_false", help="skip the naive baseline")
    p.add_argument("--ipc-verify", action="store_true", help="weights.ipc_verify (cuda-ipc)")
    p.add_argument("--ipc-copy", default="graph", choices=["graph", "foreach"])
    p.add_argument("--threads", type=int, default=1, help="torch threads of the sender")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--send-host", default="127.0.0.1", help="address of the sender (this node)")
    p.add_argument("--recv-host", default="127.0.0.1", help="address of the engines' node")
    p.add_argument(
        "--ray", default="", help="Ray cluster address: engines on the Ray node at --recv-host"
    )
    p.add_argument(
        "--delta",
        action="store_true",
        help="delta pushes vs full pushes vs the floor: fp32 master weights synced as bf16 "
        "after real AdamW steps at each --lrs (gloo, one engine; docs/weight-sync.md)",
    )
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5, 1e-3])
    p.add_argument(
        "--lora",
        action="store_true",
        help="adapter-only pushes (LoRA of each --ranks) vs the full push of the same model, "
        "same run (gloo; see weight_sync_lora)",
    )
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64], help="--lora only")
    p.add_argument("--lora-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--delta-mode", default="auto", choices=["auto", "on"], help="weights.delta")
    p.add_argument(
        "--verify", default="sampled", choices=["full", "sampled", "off"], help="--delta only"
    )
    p.add_argument("--_engine", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--nbytes", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument(
        "--link-gbit",
        type=float,
        nargs="+",
        default=[],
        metavar="N",
        help="receivers in their own network namespace behind a veth pair shaped to N Gbit/s "
        "(tc tbf; root only); several values: one run per link (default: loopback)",
    )
    p.add_argument("--_netns", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._netns:  # a receiving process of an emulated link: into its namespace first
        from asyncrl.bench.netlink import enter

        enter(args._netns)
    if args.link_gbit and not (args._engine or args._peer):
        return _over_links(p, args)
    if args._engine:
        return _serve_engine(args)
    if args._peer:
        return _floor_peer(args)
    if args.engine != "embedded" and not args.urls:
        p.error(f"--engine {args.engine} needs --urls of running servers")
    rows = _one(args)
    if args.json:
        write_json(args.json, rows)
        print(f"wrote {args.json}", file=sys.stderr)


def _one(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One benchmark (full pushes, or the ``--delta`` / ``--lora`` variant): its table
    printed, its rows returned."""
    if args.lora or args.delta:  # the variants: their own rows and table
        if args.lora:
            from asyncrl.bench.weight_sync_lora import run_lora as run
            from asyncrl.bench.weight_sync_lora import table_lora as table
        else:
            from asyncrl.bench.weight_sync_delta import run_delta as run
            from asyncrl.bench.weight_sync_delta import table_delta as table
        rows = run(args)
        print(table(rows))
        return rows
    rows = _run(args)
    print(_table(rows))
    for r in rows:
        phases = ", ".join(f"{k} {v:.3f}" for k, v in r["sender_stats_ms"].items())
        print(f"{r['engine']} {r['backend']} {r['mode']} phases (ms, medians): {phases}")
    return rows


def _over_links(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--link-gbit N [N ...]``: the whole benchmark once per emulated link, the rows of
    each tagged ``link_gbit``; one JSON of them all."""
    from asyncrl.bench.netlink import EmulatedLink, refusal

    why = refusal()
    if why:
        p.error(why)
    if args.ray or args.engine != "embedded":
        p.error("--link-gbit emulates the link to this host's own engines: not with --ray/--engine")
    rows: list[dict[str, Any]] = []
    out = args.json
    for gbit in args.link_gbit:
        with EmulatedLink(gbit) as link:
            one = argparse.Namespace(**vars(args))
            one.link_gbit, one.json = [], None
            one.send_host, one.recv_host, one.netns = link.host_addr, link.ns_addr, link.name
            print(f"-- link: {gbit:g} Gbit/s (veth + tc tbf, namespace {link.name})")
            for r in _one(one):
                rows.append({**r, "link_gbit": gbit})
    if out:
        Path(out).write_text(json.dumps(rows, indent=2))
        print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
