"""Fixtures of the controller tests: an engine in the test process for the controller and
episode logic, and an engine process for the tests of the HTTP path (test_batching)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.procs import free_port, python_env, stop
from tests.inproc import inproc_engine
from tests.runs import spawn_shared

if TYPE_CHECKING:
    from asyncrl.engines.rollout.local.inproc import InProcEngine

# tests run requests that only an abort ends: a context far beyond the model's 64
ENGINE_ARGS = {"seed": 1, "context_length": 1000000}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[InProcEngine]:
    """The embedded engine (tiny model) in this process, one per test module."""
    with inproc_engine(tiny_model_dir, **ENGINE_ARGS) as e:
        yield e


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An embedded engine server process (tiny model), one per test module."""
    port = free_port()
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    args = ["-m", "asyncrl.entrypoints.engine", "--model-path", str(tiny_model_dir)]
    args += ["--seed", str(ENGINE_ARGS["seed"]), "--context-length", "1000000"]
    proc = spawn_shared([*args, "--port", str(port)], log, python_env())
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
