"""``asyncrl bench weight-sync --delta``: delta pushes against full pushes and the floor.

Qwen2 shapes (``--model``), fp32 master weights on the sender (normal(0, 0.02)
matrices, unit norms, zero biases: a fresh model's statistics, fresh for every
learning rate) synced as bf16 (``weights.dtype = "bfloat16"``) into one engine
process serving bf16. Per learning rate (``--lrs``) the weights change by real
``torch.optim.AdamW`` steps (gradients: normal noise; Adam normalises them, so
every element moves by about ``lr`` as in any Adam step) and, per step, in the
same run and on the same link:

- ``floor_s``: one flat broadcast of as many bytes as the bf16 sync (real bytes: the
  masters' own) to a peer process;
- ``full``: our push with ``weights.delta = "off"`` (the cast and the whole
  bf16 bytes);
- ``delta``: our push with ``weights.delta = --delta-mode`` (default ``auto``):
  the cast, the comparison with the last pushed bytes, the changed words.

Both senders stay connected to the engine (two weight groups) and push every
version in turn (``PUSH_ORDER``), so the engine's bytes are the same for both. Rows (JSON: a
list): ``mode`` (full/delta), ``lr``, ``changed_frac`` (bf16 values whose bits
changed, per step), ``changed_words_frac`` (8-byte words), ``wire_bytes``,
``floor_s``, ``total_s``, ``stall_s`` (medians), ``delta_pushes`` (pushes
sent as deltas), ``verified`` (the engine's parameters equal the masters cast
to bf16, bit for bit, right after this sender's last push).

Memory: ``sender_bytes_per_param`` is what the sender itself holds between pushes
(staging slots, delta bases, compare mask; ``BucketStager.memory_bytes``) per parameter,
``sender_peak_bytes_per_param`` that plus the largest push's delta payloads, which live
until it is delivered. ``tree_rss_after_bytes``: the resident memory of this process and
its children (the engine, the floor's peer) after each rate, once its state is freed;
``tree_peak_rss_bytes``: the sum of their high-water marks so far. The stand-in trainer
holds the masters and AdamW's state (12 bytes per parameter) and a chunk's worth of
gradient and temporaries (see :class:`_Trainer`), so the process holds what a trainer
with fp32 masters would, plus the two senders.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
from pathlib import Path
from typing import Any

from asyncrl.bench import log_dir

__all__ = ["PUSH_ORDER", "run_delta", "table_delta"]

PUSH_ORDER = ("delta", "full")
"""Each step's pushes, in turn: the delta sender's first. A delta applies against what its
bucket's last push left on the engine (``delta_apply``), as a single sender's always does;
this one's does too when it goes first, since the full sender pushed the previous version
last (its base, byte for byte). Pushed second, its base would be one version behind what
the full push left, which the engine still holds only for buckets its parameters are views
of (two receive buffers each), not for one whose parameters are copies (a tensor split
across buckets, e.g. Qwen2-0.5B's 272 MB embedding at ``--bucket-mb 128``): that failed."""


def _masters(model: str) -> tuple[Any, dict[str, Any]]:
    """The fp32 masters as views of one flat buffer (returned too): normal(0, 0.02)
    matrices, unit norms, zero biases."""
    import torch

    from asyncrl.bench.weight_sync_setup import model_shapes

    shapes = model_shapes(model)
    flat = torch.empty(sum(torch.Size(s).numel() for _, s in shapes))
    g = torch.Generator().manual_seed(0)
    out, off = {}, 0
    for name, shape in shapes:
        t = out[name] = flat[off : off + torch.Size(shape).numel()].view(shape)
        off += t.numel()
        if len(shape) >= 2:
            t.normal_(0.0, 0.02, generator=g)
        else:
            t.fill_(1.0 if "norm" in name else 0.0)
    return flat, out


class _Trainer:
    """The stand-in trainer: AdamW on the fp32 masters (``flat``, viewed per tensor as
    ``named``), gradients of normal noise (Adam normalises them, so every element moves by
    about ``lr`` as in any Adam step).

    AdamW is element-wise, so it steps the flat masters in chunks of ``CHUNK`` elements, one
    optimizer each, exactly as it would step the tensors; the noise is one buffer of a chunk
    (plus ``SPREAD``), drawn once per step, each chunk taking it at its own offset. So the
    stand-in holds what a trainer with fp32 masters holds for them (masters and AdamW's two
    moments: 12 bytes per parameter) and a chunk's worth besides, never one more copy of a
    whole tensor (the embedding's update temporaries alone would be 1.6 GB for Qwen2-0.5B).
    """

    CHUNK, SPREAD = 1 << 24, 4099

    def __init__(self, flat: Any, named: dict[str, Any], lr: float):
        import torch

        self.named = named
        chunks = [flat[i : i + self.CHUNK] for i in range(0, flat.numel(), self.CHUNK)]
        self.chunks = [torch.nn.Parameter(c) for c in chunks]  # views: steps write the masters
        self.opts = [torch.optim.AdamW([c], lr=lr, foreach=False) for c in self.chunks]
        self.noise = torch.empty(self.CHUNK + self.SPREAD)
        self.gen = torch.Generator().manual_seed(1)

    def step(self) -> float:
        """One optimizer step of every parameter; the fraction of bf16 values it changed."""
        import torch

        self.noise.normal_(generator=self.gen)
        changed, numel = 0, 0
        for i, (c, opt) in enumerate(zip(self.chunks, self.opts, strict=True)):
            before = c.detach().bfloat16()
            off = (i * 257) % self.SPREAD
            c.grad = self.noise[off : off + c.numel()]
            opt.step()
            c.grad = None
            after = c.detach().bfloat16()
            changed += int((before.view(torch.int16) != after.view(torch.int16)).sum())
            numel += c.numel()
        return changed / numel

    def weights(self) -> dict[str, Any]:
        return {k: t.detach() for k, t in self.named.items()}


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


def run_delta(args: argparse.Namespace) -> list[dict[str, Any]]:
    with log_dir("asyncrl-bench-ws-delta-") as logs:
        return _run_delta(args, logs)


def _run_delta(args: argparse.Namespace, logs: Path) -> list[dict[str, Any]]:
    import torch

    from asyncrl.bench.weight_sync_setup import Children, Floor

    torch.set_num_threads(args.threads)
    me = ["-m", "asyncrl.bench.weight_sync", "--backend", "gloo", "--model", args.model]
    me += ["--dtype", "bfloat16", "--send-host", args.send_host, "--recv-host", args.recv_host]
    children = Children(args, me, logs)
    rows: list[dict[str, Any]] = []
    floor: Any = None
    try:
        engine = children.start("engine", ["--_engine", "--port", "{port}"])
        urls = [f"http://{args.recv_host}:{engine.bench_port}"]
        for lr in args.lrs:
            flat, masters = _masters(args.model)
            # the floor sends real bytes, as many as the bf16 sync: the masters' first half
            wire = flat.view(torch.uint8)[: flat.numel() * 2]
            if floor is None:
                floor = Floor("gloo", wire.numel(), children, args.send_host, wire)
            floor.buf = wire
            del wire
            try:
                rows += _one_lr(args, lr, urls, floor, _Trainer(flat, masters, lr))
            finally:
                floor.buf = None  # nothing of this rate is left
                del flat, masters
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
    from asyncrl.engines.rollout.factory import make_weight_transport

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
        for mode in PUSH_ORDER:
            senders[mode] = make_weight_transport(cfgs[mode], urls, "cpu")
            senders[mode].connect()
    except BaseException:
        for sender in senders.values():
            sender.close()
        raise
    return senders


def _one_lr(
    args: argparse.Namespace, lr: float, urls: list[str], floor: Any, trainer: _Trainer
) -> list[dict[str, Any]]:
    """Both senders' rows at one learning rate: ``repeats + 2`` steps of ``trainer``. The
    senders are gone on return."""
    from asyncrl.bench.weight_sync_arms import verified_sums

    senders = _senders(args, urls)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in senders}
    floors, fracs = [], []
    last = args.repeats + 1
    try:
        for step in range(last + 1):  # 2 warm-ups: the first push is always full
            frac = trainer.step()
            if step >= 2:
                fracs.append(frac)
            floors.append(floor.once())
            check = None
            if step == last:  # after each sender's last push: the engine holds its bytes
                check = functools.partial(verified_sums, urls, _bf16_sums(trainer.named), step + 1)
            pushed = _push_step(
                senders, trainer.weights(), step + 1, statistics.median(floors), check
            )
            if step >= 2:
                for mode, r in pushed.items():
                    runs[mode].append(r)
    finally:
        for sender in senders.values():
            sender.close()
    numel = sum(t.numel() for t in trainer.named.values())
    return [_row(args, mode, lr, rs, numel, floors, fracs) for mode, rs in runs.items()]


def _push_step(
    senders: dict[str, Any],
    weights: dict[str, Any],
    version: int,
    train_s: float,
    check: Any = None,
) -> dict[str, dict[str, float]]:
    """One step: each sender pushes ``weights`` as ``version``, in ``PUSH_ORDER``, ``train_s``
    of the trainer's work overlapping each push. Each push's stats, with ``held_bytes`` (what
    the sender holds after it) and, given ``check()`` (whether the engine holds what was
    pushed), ``verified`` (1.0 or 0.0) checked right after it."""
    from asyncrl.bench.weight_sync_arms import push_once

    out = {}
    for mode in PUSH_ORDER:
        r = push_once(senders[mode], weights, version, train_s)
        r["held_bytes"] = float(senders[mode].stager.memory_bytes())
        if check is not None:
            r["verified"] = float(check())
        out[mode] = r
    return out


def _bf16_sums(named: dict[str, Any]) -> dict[str, int]:
    """Per-tensor checksums of the masters cast to bf16: what the engine holds after a push."""
    from asyncrl.transports.weights.bucket import checksum

    return {k: checksum(p.detach().bfloat16()) for k, p in named.items()}


def _row(
    args: argparse.Namespace,
    mode: str,
    lr: float,
    rs: list[dict[str, float]],
    numel: int,
    floors: list[float],
    fracs: list[float],
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
        "verified": bool(rs[-1].get("verified", 0.0)),
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
