"""Adapter-only weight sync over CUDA IPC into embedded engines that serve LoRA (needs a GPU;
the CPU check at the end): only the adapter's tensors are mapped and copied, each version
lands in the ring beside the served ones bit for bit, nothing pauses, a wrong adapter is
refused before anything loads."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrl.config import CudaIpcWeightsConfig, load_config
from asyncrl.engines.rollout.factory import make_weight_transport
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.procs import free_port, python_env, stop
from asyncrl.transports.weights.base import WeightSyncError
from asyncrl.transports.weights.bucket import checksum
from tests.runs import spawn_shared

RANK, TARGETS = 4, ("q_proj", "v_proj")
LORA = ["--enable-lora", "--max-lora-rank", str(RANK), "--lora-alpha", "8"]
LORA += ["--lora-target-modules", ",".join(TARGETS), "--max-loaded-loras", "3"]


@contextmanager
def lora_engines(model_dir: Path, tmp: Path, n: int) -> Iterator[list[str]]:
    """``n`` embedded engines on the GPU serving LoRA (ring of 3); stopped by pid."""
    procs: list[subprocess.Popen] = []
    urls = []
    try:
        for i in range(n):
            port = free_port()
            args = ["-m", "asyncrl.entrypoints.engine", "--model-path", str(model_dir)]
            args += ["--port", str(port), "--device", "cuda", "--threads", "1", *LORA]
            procs.append(spawn_shared(args, tmp / f"engine{i}_{port}.log", python_env()))
            urls.append(f"http://127.0.0.1:{port}")
        asyncio.run(_each(urls, lambda c: c.wait_healthy(180)))
        yield urls
    finally:
        stop(procs)


async def _each(urls: list[str], call: Any) -> list[Any]:
    clients = [SGLangClient(u, timeout_s=120) for u in urls]
    try:
        return await asyncio.gather(*(call(c) for c in clients))
    finally:
        await asyncio.gather(*(c.close() for c in clients))


def adapter(model_dir: Path, seed: int, rank: int = RANK) -> dict[str, torch.Tensor]:
    """Random LoRA factors under PEFT's saved names, one CUDA allocation each."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            key = f"base_model.model.{name}"
            a, b = (rank, mod.in_features), (mod.out_features, rank)
            out[f"{key}.lora_A.weight"] = torch.randn(a, generator=gen, device="cuda")
            out[f"{key}.lora_B.weight"] = torch.randn(b, generator=gen, device="cuda")
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2])  # 1: copied and loaded in one call; 2: staged, committed
def test_cuda_ipc_adapter_pushes_land_in_the_ring(tiny_model_dir: Path, tmp_path: Path, n: int):
    a, b = adapter(tiny_model_dir, 1), adapter(tiny_model_dir, 2)
    nbytes = sum(t.numel() * t.element_size() for t in a.values())
    with lora_engines(tiny_model_dir, tmp_path, n) as urls:
        cfg = CudaIpcWeightsConfig(pause_scope="none", ipc_verify=n == 2)
        sender = make_weight_transport(cfg, urls, "cuda")
        want: dict[str, dict[str, int]] = {}
        try:
            sender.connect()
            for weights, v in ((a, 1), (a, 2), (b, 3)):  # v2: a*-1 in place, the same layout
                if v == 2:
                    for t in a.values():
                        t.mul_(-1)
                want[str(v)] = {k: checksum(t.contiguous()) for k, t in weights.items()}
                stats = sender.push(weights.items(), v).wait(120)
                assert stats["bytes"] == nbytes
            with pytest.raises(WeightSyncError, match=r"shape \(8, "):
                sender.push(adapter(tiny_model_dir, 3, rank=8).items(), 4).wait(120)
        finally:
            sender.close()
        sums = asyncio.run(_each(urls, lambda c: c._call("GET", "/get_weights_checksum")))
        infos = asyncio.run(_each(urls, lambda c: c._call("GET", "/get_server_info")))
        for got, info in zip(sums, infos, strict=True):
            assert got["weight_version"] == "3"
            assert sorted(got["adapters"]) == ["1", "2", "3"]  # ring of 3: v0 unloaded
            for v in ("1", "2", "3"):
                assert got["adapters"][v] == want[v], v
            assert info["pauses"] == 0 and info["aborted"] == 0
            assert len(info["lora"]["versions"]) == 3


def test_cuda_ipc_is_accepted_with_lora() -> None:
    """No longer refused at config: adapters travel over cuda-ipc too."""
    cfg = load_config(None, ["--lora.rank=4", "--weights.backend=cuda-ipc"])
    assert cfg.lora.enabled and isinstance(cfg.weights, CudaIpcWeightsConfig)
