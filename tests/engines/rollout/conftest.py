"""Fixtures of the rollout-engine tests: one embedded engine server process per session."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncrl.engines.rollout.base import BucketAnnouncement, GroupSpec
from asyncrl.engines.rollout.launcher import (
    LOCAL_SERVER,
    LaunchedServer,
    LaunchSpec,
    launch,
    stop_servers,
    wait_healthy,
)
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.procs import free_port
from tests.runs import spawn_shared


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    """The tiny default model in float32 for in-process engine tests (one torch thread)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def engine_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LaunchedServer]:
    """The embedded engine (tiny model) as a real server process, started by the launcher."""
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    spec = LaunchSpec(
        str(tiny_model_dir),
        free_port(),
        # tests run requests that only an abort ends: a context far beyond the model's 64
        extra_args=("--max-batch-size", "8", "--threads", "1", "--context-length", "1000000"),
        module=LOCAL_SERVER,
    )
    server = launch(spec, log, spawner=spawn_shared)
    try:
        asyncio.run(wait_healthy([server], timeout_s=120))
        yield server
    finally:
        stop_servers([server])


class WeightPusher:
    """Trainer side of weight sync in the test process: rank 0 of a Gloo group with the server."""

    def __init__(self, model_dir: Path):
        from safetensors.torch import load_file

        self.original = load_file(str(model_dir / "model.safetensors"))
        self.group = None

    async def connect(self, client: SGLangClient, group_name: str = "test_weights") -> None:
        from asyncrl.transports.weights.collective_wire import new_weight_group

        port = free_port()
        own = asyncio.to_thread(new_weight_group, "gloo", "127.0.0.1", port, 0, 2, group_name, 60)
        group = GroupSpec("127.0.0.1", port, 1, 2, group_name, "gloo")
        call = client.init_weights_update_group(group)
        self.group, _ = await asyncio.gather(own, call)
        self.group_name = group_name

    async def push(
        self, client: SGLangClient, named: dict[str, torch.Tensor], version: str
    ) -> None:
        """One flattened fp32 bucket with every tensor of ``named``; commits ``version``."""
        from asyncrl.transports.weights.collective_wire import broadcast

        flat = torch.cat([t.float().flatten() for t in named.values()])
        bucket = BucketAnnouncement(
            names=list(named),
            dtypes=["float32"] * len(named),
            shapes=[list(t.shape) for t in named.values()],
            group_name=self.group_name,
            flush_cache=True,
            weight_version=version,
            load_format="flattened_bucket",
        )
        call = client.update_weights_from_distributed(bucket)
        await asyncio.gather(asyncio.to_thread(broadcast, self.group, flat), call)


@pytest.fixture(scope="session")
def weight_pusher(tiny_model_dir: Path) -> WeightPusher:
    return WeightPusher(tiny_model_dir)
