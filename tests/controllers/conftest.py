"""Fixtures of the controller tests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.procs import free_port, python_env, stop
from tests.runs import spawn_shared


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An embedded engine server process (tiny model), one per test module."""
    port = free_port()
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    args = ["-m", "asyncrl.entrypoints.engine", "--model-path", str(tiny_model_dir)]
    # tests run requests that only an abort ends: a context far beyond the model's 64
    proc = spawn_shared(
        [*args, "--port", str(port), "--seed", "1", "--context-length", "1000000"],
        log,
        python_env(),
    )
    url = f"http://127.0.0.1:{port}"
    try:

        async def up() -> None:
            c = SGLangClient(url)
            try:
                await c.wait_healthy(120)
            finally:
                await c.close()

        asyncio.run(up())
        yield url
    finally:
        stop([proc])
