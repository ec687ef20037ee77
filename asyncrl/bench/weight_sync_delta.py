"""``asyncrl bench weight-sync --delta``: delta pushes against full pushes and the floor.

Qwen2 shapes (``--model``), fp32 master weights on the sender (normal(0, 0.02)
matrices, unit norms, zero biases: a fresh model's statistics) synced as bf16
(``weights.dtype = "bfloat16"``) into one engine process serving bf16. Per
learning rate (``--lrs``) the weights change by real ``torch.optim.AdamW``
steps (gradients: normal noise; Adam normalises them, so every element moves by
about ``lr`` as in any Adam step) and, per step, in the same run and on the
same link:

- ``floor_s``: one flat broadcast of the bf16 bytes to a peer process;
- ``full``: our push with ``weights.delta = "off"`` (the cast and the whole
  bf16 bytes);
- ``delta``: our push with ``weights.delta = --delta-mode`` (default ``auto``):
  the cast, the comparison with the last pushed bytes, the changed words.

Both senders stay connected to the engine (two weight groups) and push every
version in turn, so the engine's bytes are the same for both. Rows (JSON: a
list): ``mode`` (full/delta), ``lr``, ``changed_frac`` (bf16 values whose bits
changed, per step), ``changed_words_frac`` (8-byte words), ``wire_bytes``,
``floor_s``, ``total_s``, ``stall_s`` (medians), ``delta_pushes`` (pushes
sent as deltas), ``verified`` (the engine's parameters equal the masters cast
to bf16, bit for bit, after the last push of each sender).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["run_delta", "table_delta"]


def _masters(model: str) -> dict[str, Any]:
    import torch

    from asyncrl.bench.weight_sync import _shapes

    g = torch.Generator().manual_seed(0)
    out = {}
    for name, shape in _shapes(model):
        if len(shape) >= 2:
            out[name] = torch.randn(shape, generator=g).mul_(0.02)
        elif "norm" in name:
            out[name] = torch.ones(shape)
        else:
            out[name] = torch.zeros(shape)
    return out


def _changed(before: dict[str, Any], after: dict[str, Any]) -> float:
    import torch

    n = sum(t.numel() for t in before.values())
    diff = sum(
        int((before[k].view(torch.int16) != after[k].view(torch.int16)).sum()) for k in before
    )
    return diff / n


def run_delta(args: argparse.Namespace) -> list[dict[str, Any]]:
    import msgspec
    import torch

    from asyncrl.bench.weight_sync import _Children, _Floor, _ours, _verified
    from asyncrl.config import GlooWeightsConfig
    from asyncrl.transports.weights import make_weight_transport

    torch.set_num_threads(args.threads)
    logs = Path(tempfile.mkdtemp(prefix="asyncrl-bench-ws-delta-"))
    me = ["-m", "asyncrl.bench.weight_sync", "--backend", "gloo", "--model", args.model]
    me += ["--dtype", "bfloat16", "--send-host", args.send_host, "--recv-host", args.recv_host]
    children = _Children(args, me, logs)
    engine = children.start("engine", ["--_engine", "--port", "{port}"])
    urls = [f"http://{args.recv_host}:{engine.bench_port}"]
    base = GlooWeightsConfig(
        dtype="bfloat16",
        timeout_s=600.0,
        bucket_mb=args.bucket_mb,
        min_buckets=args.min_buckets,
        verify=args.verify,
        full_every=0,
        master_address=args.send_host,
    )
    cfgs = {
        "full": msgspec.structs.replace(base, group_name="bench_full"),
        "delta": msgspec.structs.replace(base, delta=args.delta_mode, group_name="bench_delta"),
    }
    rows: list[dict[str, Any]] = []
    senders: dict[str, Any] = {}
    try:
        masters = _masters(args.model)
        nbytes = sum(t.numel() * 2 for t in masters.values())
        floor = _Floor("gloo", nbytes, children, args.send_host)
        for lr in args.lrs:
            for mode, cfg in cfgs.items():
                senders[mode] = make_weight_transport(cfg, urls, "cpu")
                senders[mode].connect()
            params = [torch.nn.Parameter(t) for t in masters.values()]
            named = dict(zip(masters, params, strict=True))
            opt = torch.optim.AdamW(params, lr=lr)
            runs: dict[str, list[dict[str, float]]] = {m: [] for m in cfgs}
            floors, fracs = [], []
            version = 0
            for step in range(args.repeats + 2):  # 2 warm-ups: the first push is always full
                before = {k: p.detach().bfloat16() for k, p in named.items()} if step else None
                for p in params:
                    p.grad = torch.randn_like(p)
                opt.step()
                weights = {k: p.detach() for k, p in named.items()}
                if before is not None:
                    fracs.append(_changed(before, {k: t.bfloat16() for k, t in weights.items()}))
                floors.append(floor.once())
                version += 1
                for mode, sender in senders.items():
                    r = _ours(sender, weights, version, statistics.median(floors))
                    if step >= 2:
                        runs[mode].append(r)
            check = {k: t.bfloat16() for k, t in weights.items()}
            verified = _verified(urls, check, version)
            for sender in senders.values():
                sender.close()
            senders = {}
            floor_s = statistics.median(floors)
            for mode, rs in runs.items():
                total_s = statistics.median(r["total_s"] for r in rs)
                words = nbytes / 8
                rows.append(
                    {
                        "mode": mode,
                        "lr": lr,
                        "model": args.model,
                        "bytes": nbytes,
                        "changed_frac": statistics.median(fracs),
                        "changed_words_frac": statistics.median(
                            r.get("changed_words", 0.0) / words for r in rs
                        ),
                        "wire_bytes": statistics.median(r["wire_bytes"] for r in rs),
                        "floor_s": floor_s,
                        "total_s": total_s,
                        "stall_s": statistics.median(r["stall_s"] for r in rs),
                        "total_over_floor": total_s / floor_s,
                        "delta_pushes": sum(int(r.get("delta", 0.0)) for r in rs),
                        "pushes": len(rs),
                        "verify": args.verify,
                        "verified": verified,
                        "total_runs_s": [r["total_s"] for r in rs],
                    }
                )
    finally:
        for sender in senders.values():
            sender.close()
        children.stop()
    return rows


def table_delta(rows: list[dict[str, Any]]) -> str:
    cols = ["mode", "lr", "changed_frac", "changed_words_frac", "wire_bytes", "floor_s"]
    cols += ["total_s", "stall_s", "total_over_floor", "delta_pushes", "verified"]
    fmt = lambda v: f"{v:.5g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = [" | ".join(cols)]
    lines += [" | ".join(fmt(r[c]) for c in cols) for r in rows]
    return "\n".join(lines)
