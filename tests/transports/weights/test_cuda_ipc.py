"""CUDA IPC weight sync into a colocated embedded engine (needs a GPU)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from asyncrl.config import WeightSyncConfig
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.procs import free_port, spawn, stop
from asyncrl.transports.weights import make_weight_transport
from asyncrl.transports.weights.bucket import checksum


async def _checksums(url: str) -> dict:
    client = SGLangClient(url)
    try:
        await client.wait_healthy(120)
        return await client._call("GET", "/get_weights_checksum")
    finally:
        await client.close()


@pytest.mark.gpu
def test_cuda_ipc_push_into_a_gpu_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    port = free_port()
    args = ["-m", "asyncrl.engines.rollout.local.server", "--model-path", str(tiny_model_dir)]
    proc = spawn([*args, "--port", str(port), "--device", "cuda"], tmp_path / "engine.log")
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(_checksums(url))
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).cuda()
        weights = {n: torch.randn_like(p) for n, p in model.named_parameters()}
        cfg = WeightSyncConfig(backend="cuda-ipc", min_buckets=3)
        sender = make_weight_transport(cfg, [url], "cuda")
        try:
            sender.connect()
            for version in (1, 2):
                weights = {n: t + 1 for n, t in weights.items()}
                sender.push(weights.items(), version).wait(120)
        finally:
            sender.close()
        state = asyncio.run(_checksums(url))
        assert state["weight_version"] == "2"
        assert state["checksums"] == {n: checksum(t) for n, t in weights.items()}
    finally:
        stop([proc])
