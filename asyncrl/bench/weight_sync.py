"""Weight-sync benchmark: our bucketed stream vs. the link's floor and per-tensor broadcasts.

``asyncrl bench weight-sync --backend gloo|nccl|hccl|cuda-ipc [--model qwen2-0.5b|qwen2-1.5b]
[--engines N] [--engine sglang|vllm --urls URL[,URL]] [--json PATH]`` (``--delta``: delta
pushes, ``weight_sync_delta``; ``--lora``: adapter-only pushes vs the full push,
``weight_sync_lora``; ``--engine``: the same pushes into running SGLang or vLLM servers too,
rows beside the embedded engine's, ``weight_sync_engines``). This module is the command
line, the table and the JSON; ``weight_sync_setup`` makes the weights and the receiving
processes, ``weight_sync_arms`` measures the arms into rows.

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
import sys
from typing import Any

from asyncrl.bench import bench_parser
from asyncrl.bench.common import write_json
from asyncrl.bench.weight_sync_setup import DEVICE, MODELS

__all__ = ["MODELS", "main"]


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
    p = _parser()
    args = p.parse_args(argv)
    if args._netns:  # a receiving process of an emulated link: into its namespace first
        from asyncrl.bench.netlink import enter

        enter(args._netns)
    if args.link_gbit and not (args._engine or args._peer):
        return _over_links(p, args)
    if args._engine:
        from asyncrl.bench.weight_sync_setup import serve_engine

        return serve_engine(args)
    if args._peer:
        from asyncrl.bench.weight_sync_setup import floor_peer

        return floor_peer(args)
    if args.engine != "embedded" and not args.urls:
        p.error(f"--engine {args.engine} needs --urls of running servers")
    rows = _one(args)
    if args.json:
        write_json(args.json, rows)
        print(f"wrote {args.json}", file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    """The options of a full-push run; :func:`_more_options` adds the variants' and the
    receiving processes'."""
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
    _more_options(p)
    return p


def _more_options(p: argparse.ArgumentParser) -> None:
    """``--delta``, ``--lora``, ``--link-gbit`` and the hidden options of the receiving
    processes (``--_engine``, ``--_peer``, ``--_netns``)."""
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
    from asyncrl.bench.weight_sync_arms import run

    rows = run(args)
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
        write_json(out, rows)
        print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
