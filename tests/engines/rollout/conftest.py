"""Fixtures of the rollout-engine tests: one embedded engine server process per session."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.engines.rollout.launcher import (
    LOCAL_SERVER,
    LaunchedServer,
    LaunchSpec,
    launch,
    stop_servers,
    wait_healthy,
)
from asyncrl.procs import free_port


@pytest.fixture(scope="session")
def engine_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LaunchedServer]:
    """The embedded engine (tiny model) as a real server process, started by the launcher."""
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    spec = LaunchSpec(
        str(tiny_model_dir),
        free_port(),
        extra_args=("--max-batch-size", "8", "--threads", "1"),
        module=LOCAL_SERVER,
    )
    server = launch(spec, log)
    try:
        asyncio.run(wait_healthy([server], timeout_s=120))
        yield server
    finally:
        stop_servers([server])
