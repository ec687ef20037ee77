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
import os
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


class _Noise:
    """Gradients: views of one buffer of normal noise (as large as the largest parameter plus
    a little), drawn again every step, each parameter at its own offset. Adam normalises
    gradients, so every element still moves by about ``lr``; the trainer stand-in then
    holds one parameter's worth of gradient instead of a whole model's."""

    SPREAD = 4099

    def __init__(self, params: list[Any]):
        import torch

        self.params = params
        self.buf = torch.empty(max(p.numel() for p in params) + self.SPREAD)

    def step(self, gen: Any) -> None:
        self.buf.normal_(generator=gen)
        for i, p in enumerate(self.params):
            off = (i * 257) % self.SPREAD
            p.grad = self.buf[off : off + p.numel()].view(p.shape)


def _tree_bytes(peak: bool) -> int:
    """Resident bytes of this process and its descendants (the engine, the floor's peer),
    summed: now, or (``peak``) the sum of each one's high-water mark, an upper bound of the
    tree's peak that no sampling can miss."""
    from asyncrl.procs import descendants, rss_bytes

    me = os.getpid()
    return sum(rss_bytes(p, peak) for p in [me, *descendants(me)])


def _release_memory() -> None:
    """Give freed memory back to the system between learning rates: collect, then (glibc)
    ``malloc_trim``, so the next rate starts from the same footprint."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _changed(before: dict[str, Any], named: dict[str, Any]) -> float:
    """bf16 values whose bits differ between ``before`` and the parameters cast to bf16."""
    import torch

    n = sum(t.numel() for t in before.values())
    diff = 0
    for k, p in named.items():  # one parameter's cast at a time
        diff += int((before[k].view(torch.int16) != p.detach().bfloat16().view(torch.int16)).sum())
    return diff / n


def _bf16_views(shapes: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """One flat bf16 buffer (zeroed) and a view of it per tensor, in the given shapes."""
    import torch

    flat = torch.zeros(sum(s.numel() for s in shapes.values()), dtype=torch.bfloat16)
    views, off = {}, 0
    for name, shape in shapes.items():
        views[name] = flat[off : off + shape.numel()].view(shape)
        off += shape.numel()
    return flat, views


def run_delta(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from asyncrl.bench.weight_sync import _Children, _Floor, _shapes

    torch.set_num_threads(args.threads)
    logs = Path(tempfile.mkdtemp(prefix="asyncrl-bench-ws-delta-"))
    me = ["-m", "asyncrl.bench.weight_sync", "--backend", "gloo", "--model", args.model]
    me += ["--dtype", "bfloat16", "--send-host", args.send_host, "--recv-host", args.recv_host]
    children = _Children(args, me, logs)
    rows: list[dict[str, Any]] = []
    try:
        engine = children.start("engine", ["--_engine", "--port", "{port}"])
        urls = [f"http://{args.recv_host}:{engine.bench_port}"]
        # the bf16 values before each step: what the changed fraction compares against, and
        # the floor's bytes (one flat broadcast of the synced bytes)
        flat, before = _bf16_views({n: torch.Size(s) for n, s in _shapes(args.model)})
        floor = _Floor("gloo", flat.numel() * 2, children, args.send_host, flat.view(torch.uint8))
        for lr in args.lrs:
            rows += _one_lr(args, lr, urls, floor, before)
            _release_memory()
            for r in rows[-2:]:  # so far: the same after every rate when none adds memory
                r["tree_rss_after_bytes"] = _tree_bytes(peak=False)
                r["tree_peak_rss_bytes"] = _tree_bytes(peak=True)
    finally:
        children.stop()
    return rows


def _senders(args: argparse.Namespace, urls: list[str]) -> dict[str, Any]:
    """The full and the delta sender, connected (two weight groups into the one engine)."""
    import msgspec

    from asyncrl.config import GlooWeightsConfig
    from asyncrl.transports.weights import make_weight_transport

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
    senders: dict[str, Any] = {}
    try:
        for mode, cfg in cfgs.items():
            senders[mode] = make_weight_transport(cfg, urls, "cpu")
            senders[mode].connect()
    except BaseException:
        for sender in senders.values():
            sender.close()
        raise
    return senders


def _one_lr(
    args: argparse.Namespace, lr: float, urls: list[str], floor: Any, before: dict[str, Any]
) -> list[dict[str, Any]]:
    """Both senders' rows at one learning rate: fresh masters, AdamW, ``repeats + 2`` steps.
    Everything of this rate (masters, optimizer state, senders) is gone on return."""
    import torch

    from asyncrl.bench.weight_sync import _ours

    masters = _masters(args.model)
    params = [torch.nn.Parameter(t) for t in masters.values()]
    named = dict(zip(masters, params, strict=True))
    del masters
    # foreach=False: the per-tensor step, without the fused step's whole-model temporaries
    opt = torch.optim.AdamW(params, lr=lr, foreach=False)
    noise, gen = _Noise(params), torch.Generator().manual_seed(1)
    senders = _senders(args, urls)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in senders}
    floors, fracs = [], []
    try:
        for step in range(args.repeats + 2):  # 2 warm-ups: the first push is always full
            for k, p in named.items():
                before[k].copy_(p.detach())
            noise.step(gen)
            opt.step()
            if step >= 2:
                fracs.append(_changed(before, named))
            floors.append(floor.once())
            weights = {k: p.detach() for k, p in named.items()}
            for mode, sender in senders.items():
                r = _ours(sender, weights, step + 1, statistics.median(floors))
                r["held_bytes"] = float(sender.stager.memory_bytes())
                if step >= 2:
                    runs[mode].append(r)
        verified = _verified_now(urls, named, args.repeats + 2)
    finally:
        for sender in senders.values():
            sender.close()
    numel = sum(p.numel() for p in params)
    return [_row(args, mode, lr, rs, numel, floors, fracs, verified) for mode, rs in runs.items()]


def _verified_now(urls: list[str], named: dict[str, Any], version: int) -> bool:
    """The engine holds ``version`` and the masters cast to bf16, bit for bit."""
    from asyncrl.bench.weight_sync import _verified_sums
    from asyncrl.transports.weights.bucket import checksum

    want = {k: checksum(p.detach().bfloat16()) for k, p in named.items()}
    return _verified_sums(urls, want, version)


def _row(
    args: argparse.Namespace,
    mode: str,
    lr: float,
    rs: list[dict[str, float]],
    numel: int,
    floors: list[float],
    fracs: list[float],
    verified: bool,
) -> dict[str, Any]:
    nbytes = numel * 2
    floor_s = statistics.median(floors)
    total_s = statistics.median(r["total_s"] for r in rs)
    held = max(r["held_bytes"] for r in rs)
    peak = max(r["held_bytes"] + r.get("payload_bytes", 0.0) for r in rs)
    return {
        "mode": mode,
        "lr": lr,
        "model": args.model,
        "params": numel,
        "bytes": nbytes,
        "changed_frac": statistics.median(fracs),
        "changed_words_frac": statistics.median(
            r.get("changed_words", 0.0) / (nbytes / 8) for r in rs
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
        # what the sender itself holds (staging slots, delta bases, compare mask) between
        # pushes, and with a push's delta payloads while it is in flight
        "sender_held_bytes": held,
        "sender_bytes_per_param": held / numel,
        "sender_peak_bytes_per_param": peak / numel,
    }


def table_delta(rows: list[dict[str, Any]]) -> str:
    cols = ["mode", "lr", "changed_frac", "changed_words_frac", "wire_bytes", "floor_s"]
    cols += ["total_s", "stall_s", "total_over_floor", "delta_pushes", "verified"]
    cols += ["sender_bytes_per_param", "sender_peak_bytes_per_param", "tree_peak_rss_bytes"]
    fmt = lambda v: f"{v:.5g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = [" | ".join(cols)]
    lines += [" | ".join(fmt(r[c]) for c in cols) for r in rows]
    return "\n".join(lines)
