"""Adapter-only weight sync (Gloo) from a LoRA train engine into a real embedded engine that
serves LoRA: only the adapter moves, every pushed version equals the trainer's bit for bit,
generation is never paused or aborted, and a request pinned to an older version runs on it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from asyncrl.config import GlooWeightsConfig, load_config
from asyncrl.engines.rollout.base import EngineError
from asyncrl.engines.rollout.factory import make_weight_transport
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.engines.train.fsdp import FSDPEngine
from asyncrl.procs import python_env, stop
from asyncrl.transports.weights.base import WeightSyncError
from asyncrl.transports.weights.bucket import checksum
from tests.engines.train._ranks import TokenMeanLoss, make_batch
from tests.marks import needs_peft
from tests.runs import spawn_shared

pytestmark = needs_peft  # (not importorskip: see tests/marks.py)

CFG = GlooWeightsConfig(bucket_mb=1, min_buckets=2, timeout_s=60.0, pause_scope="none")
LORA = ["--lora.rank=4", "--lora.alpha=8", "--lora.target_modules=q_proj,v_proj"]
ENGINE_LORA = ["--enable-lora", "--max-lora-rank", "4", "--lora-alpha", "8"]
ENGINE_LORA += ["--lora-target-modules", "q_proj,v_proj", "--max-loaded-loras", "3"]


@pytest.fixture(scope="module")
def url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from asyncrl.procs import free_port

    port = free_port()
    args = ["-m", "asyncrl.entrypoints.engine", "--model-path", str(tiny_model_dir)]
    args += ["--port", str(port), "--context-length", "100000", "--threads", "1", *ENGINE_LORA]
    log = tmp_path_factory.mktemp("lora_sync") / "engine.log"
    proc = spawn_shared(args, log, python_env())
    try:
        asyncio.run(_call(f"http://127.0.0.1:{port}", "wait_healthy", 180))
        yield f"http://127.0.0.1:{port}"
    finally:
        stop([proc])


async def _call(url: str, method: str, *args: object) -> object:
    client = SGLangClient(url, timeout_s=120)
    try:
        return await getattr(client, method)(*args)
    finally:
        await client.close()


async def _get(url: str, path: str) -> dict:
    client = SGLangClient(url)
    try:
        return await client._call("GET", path)
    finally:
        await client.close()


async def _generate(url: str, body: dict) -> dict:
    client = SGLangClient(url, timeout_s=120)
    try:
        return await client._call("POST", "/generate", body)
    finally:
        await client.close()


def test_adapter_only_pushes_are_exact_and_pause_nothing(tiny_model_dir: Path, url: str) -> None:
    torch.set_num_threads(1)
    cfg = load_config(None, ["--lora.lr=0.05", *LORA])
    trainer = FSDPEngine(str(tiny_model_dir), cfg)
    sender = make_weight_transport(CFG, [url], "cpu")
    adapter_bytes = sum(t.numel() * t.element_size() for _, t in trainer.named_weights())
    model_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())

    async def scenario() -> None:
        long = asyncio.ensure_future(  # admitted under v0; runs while v1 and v2 load
            _generate(
                url,
                {
                    "input_ids": [1, 3, 4],
                    "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
                },
            )
        )
        await _until_running(url)
        for v in (1, 2):
            trainer.train_batch(make_batch(v), TokenMeanLoss())
            want = {n: checksum(t.contiguous()) for n, t in trainer.named_weights()}
            stats = await asyncio.to_thread(
                lambda v=v: sender.push(trainer.named_weights(), v).wait()
            )
            assert stats["pauses"] == 0 and stats["bytes"] == adapter_bytes < model_bytes / 10
            got = await _get(url, "/get_weights_checksum")
            assert got["weight_version"] == str(v) and got["adapters"][str(v)] == want
        assert not long.done(), "the long request must still run for the test to mean anything"
        pinned = await _generate(
            url,
            {
                "input_ids": [1, 5],
                "lora_path": "policy-v1",
                "sampling_params": {"max_new_tokens": 3},
            },
        )
        assert pinned["meta_info"]["weight_version"] == "1"
        newest = await _generate(
            url, {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 3}}
        )
        assert newest["meta_info"]["weight_version"] == "2"
        with pytest.raises(
            EngineError, match="holds adapter versions policy-v0, policy-v1, policy-v2"
        ) as e:
            await _generate(url, {"input_ids": [1, 5], "lora_path": "policy-v9"})
        assert e.value.status == 400
        done = await asyncio.wait_for(long, 300)
        assert done["meta_info"]["weight_version"] == "0"  # every token of it: v0's
        assert len(done["output_ids"]) == 1500

    try:
        sender.connect()
        asyncio.run(scenario())
        info = asyncio.run(_get(url, "/get_server_info"))
        assert info["pauses"] == 0 and info["aborted"] == 0
        assert info["lora"]["capacity"] == 3 and len(info["lora"]["versions"]) == 3
        assert info["lora"]["bytes"] == 3 * adapter_bytes
        # an adapter of another rank does not fit: refused before anything loads
        other = FSDPEngine(str(tiny_model_dir), load_config(None, [*LORA, "--lora.rank=8"]))
        with pytest.raises(WeightSyncError, match=r"shape \(8, 64\) != \(4, 64\)"):
            sender.push(other.named_weights(), 3).wait()
        got = asyncio.run(_get(url, "/get_weights_checksum"))
        assert got["weight_version"] == "2" and sorted(got["adapters"]) == ["0", "1", "2"]
    finally:
        sender.close()
    print(msgspec.json.encode(info).decode())


async def _until_running(url: str, timeout_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (await _get(url, "/get_server_info"))["decode_steps"] < 5:
        assert loop.time() < deadline, "the long request never started decoding"
        await asyncio.sleep(0.05)
