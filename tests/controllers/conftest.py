"""Fixtures of the controller tests: an engine in the test process for the controller and
episode logic, and an engine process for the tests of the HTTP path (test_batching)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.inproc import inproc_engine
from tests.runs import engine_server

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
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with engine_server(tiny_model_dir, log, **ENGINE_ARGS) as url:
        yield url
