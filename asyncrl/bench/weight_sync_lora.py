"""``asyncrl bench weight-sync --lora``: adapter-only pushes against full pushes of one model.

Qwen2 shapes (``--model``), random bits in ``--dtype``, over Gloo, in the same run and on
the same link: one embedded-engine process serving the model (the baseline: a full push,
every parameter) and, per rank in ``--ranks``, one serving it with LoRA of that rank on
``lora.target_modules``' default layers (an adapter push: ``lora_A`` and ``lora_B`` of every
target layer under PEFT's saved names, loaded beside the served versions: no pause). Per
repeat (after one warm-up) the full push and then each adapter push, in turn, each with
the simulated train step of the weight-sync bench (a sleep) between its push call and the
wait before the next optimizer step. Rows (JSON: a list), medians over ``--repeats``:

- ``mode`` (``full`` | ``lora``), ``rank``, ``tensors``, ``bytes`` (what one push moves);
- ``total_s``: ``push`` until the engine verified, loaded and acknowledged the version;
- ``stall_s``: the push call plus the wait before the next optimizer step;
- ``bytes_vs_full`` / ``time_vs_full``: the full push's bytes / time over this row's;
- ``verified``: after the last push the engine holds the sender's tensors bit for bit
  (its ``/get_weights_checksum``: the parameters, or that adapter version's factors).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from asyncrl.bench import log_dir

__all__ = ["adapter_shapes", "run_lora", "table_lora"]

STEP_S = 0.05  # the simulated train step between a push call and the next optimizer step


def adapter_shapes(model: str, rank: int) -> list[tuple[str, tuple[int, ...]]]:
    """The LoRA factors of ``model`` at ``rank`` on the default target layers, under PEFT's
    saved names: ``base_model.model.<layer>.lora_A.weight`` ``(rank, in)``, ``lora_B``
    ``(out, rank)``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.bench.weight_sync_setup import MODELS
    from asyncrl.config import LoraConfig

    targets = set(LoraConfig().target_modules)
    with torch.device("meta"):
        m = Qwen2ForCausalLM(Qwen2Config(**MODELS[model]))
    out: list[tuple[str, tuple[int, ...]]] = []
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            out.append((f"base_model.model.{name}.lora_A.weight", (rank, mod.in_features)))
            out.append((f"base_model.model.{name}.lora_B.weight", (mod.out_features, rank)))
    return out


def _random(shapes: list[tuple[str, tuple[int, ...]]], dtype: str, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    return {n: torch.randn(s, generator=g).to(dt) for n, s in shapes}


def _sender(url: str, group: str, lora: bool) -> Any:
    """A run's sender: adapter pushes pause nothing (``pause_scope = "none"``, as the trainer
    sets it for LoRA); a full push pauses around its commit (the default)."""
    from asyncrl.config import GlooWeightsConfig
    from asyncrl.engines.rollout.factory import make_weight_transport

    cfg = GlooWeightsConfig(
        timeout_s=600.0,
        group_name=group,
        verify="sampled",
        pause_scope="none" if lora else "commit",
    )
    sender = make_weight_transport(cfg, [url], "cpu")
    sender.connect()
    return sender


def run_lora(args: argparse.Namespace) -> list[dict[str, Any]]:
    with log_dir("asyncrl-bench-ws-lora-") as logs:
        return _run_lora(args, logs)


def _run_lora(args: argparse.Namespace, logs: Path) -> list[dict[str, Any]]:
    import torch

    from asyncrl.bench.weight_sync_arms import push_once
    from asyncrl.bench.weight_sync_setup import Children, random_weights

    torch.set_num_threads(args.threads)
    me = ["-m", "asyncrl.bench.weight_sync", "--backend", "gloo", "--model", args.model]
    me += ["--dtype", args.dtype, "--send-host", args.send_host, "--recv-host", args.recv_host]
    children = Children(args, me, logs)
    senders: dict[str, Any] = {}
    urls: dict[str, str] = {}
    try:
        payloads: dict[str, dict[str, Any]] = {
            "full": random_weights(args.model, args.dtype, "cpu")
        }
        ranks: dict[str, int] = {"full": 0}
        for r in args.ranks:
            key = f"lora-r{r}"
            payloads[key] = _random(adapter_shapes(args.model, r), args.dtype, r)
            ranks[key] = r
        for key, r in ranks.items():
            extra = ["--_engine", "--port", "{port}"] + (["--lora-rank", str(r)] if r else [])
            engine = children.start(key, extra)
            urls[key] = f"http://{args.recv_host}:{engine.bench_port}"
            senders[key] = _sender(urls[key], f"bench_{key}", lora=r > 0)
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in senders}
        for step in range(args.repeats + 1):  # one warm-up
            for key, sender in senders.items():
                r = push_once(sender, payloads[key], step + 1, STEP_S)
                if step >= 1:
                    runs[key].append(r)
        verified = {k: _verified(urls[k], payloads[k], args.repeats + 1) for k in senders}
    finally:
        for s in senders.values():
            s.close()
        children.stop()
    return _rows(args, runs, payloads, ranks, verified)


def _verified(url: str, payload: dict[str, Any], version: int) -> bool:
    """The engine holds ``payload`` as ``version`` (an adapter version's factors, or the
    parameters), bit for bit."""
    import asyncio

    from asyncrl.bench.weight_sync_arms import engine_checksums
    from asyncrl.transports.weights.bucket import checksum

    want = {n: checksum(t.contiguous()) for n, t in payload.items()}
    (state,) = asyncio.run(engine_checksums([url]))
    if "adapters" in state:
        return state["adapters"].get(str(version)) == want
    return state["weight_version"] == str(version) and state["checksums"] == want


def _rows(
    args: argparse.Namespace,
    runs: dict[str, list[dict[str, float]]],
    payloads: dict[str, dict[str, Any]],
    ranks: dict[str, int],
    verified: dict[str, bool],
) -> list[dict[str, Any]]:
    full_bytes = sum(t.nbytes for t in payloads["full"].values())
    full_s = statistics.median(r["total_s"] for r in runs["full"])
    rows = []
    for key, rs in runs.items():
        nbytes = sum(t.nbytes for t in payloads[key].values())
        total_s = statistics.median(r["total_s"] for r in rs)
        rows.append(
            {
                "mode": "full" if key == "full" else "lora",
                "rank": ranks[key],
                "model": args.model,
                "dtype": args.dtype,
                "tensors": len(payloads[key]),
                "bytes": nbytes,
                "total_s": total_s,
                "stall_s": statistics.median(r["stall_s"] for r in rs),
                "bytes_vs_full": full_bytes / nbytes,
                "time_vs_full": full_s / total_s,
                "pushes": len(rs),
                "verified": verified[key],
                "total_runs_s": [r["total_s"] for r in rs],
            }
        )
    return rows


def table_lora(rows: list[dict[str, Any]]) -> str:
    cols = ["mode", "rank", "tensors", "bytes", "total_s", "stall_s", "bytes_vs_full"]
    cols += ["time_vs_full", "verified"]
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = [" | ".join(cols)]
    lines += [" | ".join(fmt(r[c]) for c in cols) for r in rows]
    return "\n".join(lines)
