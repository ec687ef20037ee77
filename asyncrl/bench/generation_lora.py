"""``asyncrl bench generation --lora-rank R``: the embedded engine's throughput serving LoRA
adapters, beside the same engine serving the base model (same workload, same run).

Two more rows: ``lora`` (one adapter version, every request names it: every row of a batch
on one version, PEFT's own matmuls) and ``lora-mixed`` (two versions, requests alternate
between them: every batch mixes versions, the per-row path of ``local/lora.py``). The
engine serves ``R`` on ``lora.target_modules``' default layers with a ring of 3; the
adapters (random factors) arrive as in a run, adapter-only over Gloo.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from asyncrl.bench import log_dir
from asyncrl.bench.common import start

__all__ = ["bench_lora"]


def _factors(model_dir: Path, rank: int, seed: int) -> dict[str, Any]:
    """Random LoRA factors for the model at ``model_dir`` (PEFT's saved names)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.config import LoraConfig

    targets = set(LoraConfig().target_modules)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            a, b = (rank, mod.in_features), (mod.out_features, rank)
            out[f"base_model.model.{name}.lora_A.weight"] = torch.randn(a, generator=g) * 0.02
            out[f"base_model.model.{name}.lora_B.weight"] = torch.randn(b, generator=g) * 0.02
    return out


def bench_lora(args: argparse.Namespace, model_dir: Path, reqs: list) -> dict[str, Any]:
    """The embedded engine serving LoRA versions (one, then two mixed) vs nothing else."""
    with log_dir("asyncrl-bench-lora-") as logs:
        return _bench_lora(args, model_dir, reqs, logs / "engine.log")


def _bench_lora(args: argparse.Namespace, model_dir: Path, reqs: list, log: Path) -> dict[str, Any]:
    """Tokens/s of one LoRA engine: ``lora`` (one version) then ``lora-mixed`` (two)."""
    from asyncrl.bench.generation import _engine_run
    from asyncrl.config import GlooWeightsConfig, LoraConfig
    from asyncrl.engines.rollout.factory import make_weight_transport
    from asyncrl.engines.rollout.launcher import (
        LOCAL_SERVER,
        LaunchSpec,
        launch,
        stop_servers,
        wait_healthy,
    )
    from asyncrl.procs import free_port

    lc = LoraConfig(rank=args.lora_rank)
    extra: tuple[str, ...] = ("--device", args.device, "--threads", str(args.threads))
    extra += ("--max-batch-size", str(args.max_batch_size), "--dtype", args.dtype)
    extra += ("--enable-lora", "--max-lora-rank", str(lc.rank), "--lora-alpha", repr(lc.alpha))
    extra += ("--lora-target-modules", ",".join(lc.target_modules), "--max-loaded-loras", "3")
    spec = LaunchSpec(str(model_dir), free_port(), module=LOCAL_SERVER, extra_args=extra)
    server = launch(spec, log, spawner=start)
    sender = None
    out: dict[str, Any] = {}
    try:
        asyncio.run(wait_healthy([server], timeout_s=300))
        cfg = GlooWeightsConfig(timeout_s=300.0, pause_scope="none")  # as a LoRA run's
        sender = make_weight_transport(cfg, [server.url], "cpu")
        sender.connect()
        for v in (1, 2):
            sender.push(_factors(model_dir, lc.rank, v).items(), v).wait(300)
        for name, paths in (("lora", ["policy-v2"]), ("lora-mixed", ["policy-v1", "policy-v2"])):
            named = [(p, n, paths[i % len(paths)]) for i, (p, n) in enumerate(reqs)]
            wall = asyncio.run(_engine_run(server.url, named, args.arrival_s))
            tokens = sum(n for _, n in reqs)
            out[name] = {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}
    finally:
        if sender is not None:
            sender.close()
        stop_servers([server])
    return out
