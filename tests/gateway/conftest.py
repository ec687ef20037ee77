"""Fixtures of the gateway tests: a real embedded engine (tiny chat model; in the test
process, tests/inproc.py, or as a server process for the tests of the HTTP path:
test_agent_command) and, in a thread of their own, a controller with the gateway in front."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from asyncrl.config import AlgoConfig, ControllerConfig, GatewayConfig, RunConfig
from asyncrl.core import GenerateResult
from tests.inproc import inproc_engine
from tests.runs import engine_server

if TYPE_CHECKING:
    from asyncrl.engines.rollout.base import ManagedEngine
    from asyncrl.engines.rollout.local.inproc import InProcEngine

ENGINE_ARGS = {"seed": 1, "max_batch_size": 16}


@pytest.fixture(scope="session")
def chat_model_dir() -> Path:
    from asyncrl.tasks.tiny_chat_model import ensure_tiny_chat_model

    return ensure_tiny_chat_model()


def gateway_auth() -> dict[str, str]:
    """The ``Authorization`` header of the gateway key every default-config gateway of this
    test process holds (derived from the test session's run secret)."""
    from asyncrl import secret
    from asyncrl.gateway.auth import gateway_key

    return {"Authorization": f"Bearer {gateway_key(secret.load())}"}


class RecordingEngine:
    """The real client of the engine, keeping every final answer (rid, input, result)."""

    def __init__(self, client: ManagedEngine):
        self.client = client
        self.url = client.url
        self.results: list[tuple[str, list[int], GenerateResult]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def generate(self, input_ids: list[int], sp: dict[str, Any], rid: Any = None) -> Any:
        res = await self.client.generate(input_ids, sp, rid=rid)
        self.results.append((str(rid), list(input_ids), res))
        return res

    async def generate_stream(
        self, input_ids: list[int], sp: dict[str, Any], rid: Any = None
    ) -> AsyncIterator[GenerateResult]:
        async for res in self.client.generate_stream(input_ids, sp, rid=rid):
            if res.finish_reason:
                self.results.append((str(rid), list(input_ids), res))
            yield res


DEFAULT_CFG = RunConfig(
    controller=ControllerConfig(batch_size=1, max_staleness=200),
    algo=AlgoConfig(group_size=1),
    gateway=GatewayConfig(enabled=True, max_tokens=48, admission_timeout_s=10),
)


class Served:
    """Engine client + controller + gateway; ``run(coro)`` runs on their loop."""

    def __init__(
        self,
        model: Path,
        engine: ManagedEngine,
        cfg: RunConfig | None = None,
        advance: bool = False,
    ):
        """``engine``: the engine's client (shared: not closed here). ``cfg``: the run's config
        (default: a lenient gateway, staleness 200).
        ``advance``: each batch handed out advances the controller's version by one, as a
        trainer step would (admission opens by it)."""
        self.advance = advance
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.batches: list[Any] = []
        self.run(self._start(model, engine, cfg or DEFAULT_CFG))

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, model: Path, engine: ManagedEngine, cfg: RunConfig) -> None:
        from asyncrl.controllers.controller import Controller
        from asyncrl.gateway import Gateway

        self.engine = RecordingEngine(engine)
        await self.engine.client.wait_healthy(120)
        self.gw = Gateway(cfg.gateway, str(model))
        self.ctl = Controller(cfg, self.gw.episode, engines=[self.engine])
        self.gw.attach(self.ctl)
        await self.ctl.__aenter__()
        self.url = await self.gw.start()
        self.key = self.gw.api_key  # the gateway key (derived from the run secret by default)
        self.drain = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        while True:
            batch = await self.ctl.next_batch()
            self.batches.append(batch)
            await self.ctl.set_version(self.ctl.staleness.version + self.advance)

    async def _stop(self) -> None:
        self.drain.cancel()
        await self.gw.close()
        await self.ctl.close()

    def close(self) -> None:
        try:
            self.run(self._stop(), 30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


@pytest.fixture(scope="module")
def engine(chat_model_dir: Path) -> Iterator[InProcEngine]:
    """The embedded engine (tiny chat model) in this process, one per test module."""
    with inproc_engine(chat_model_dir, **ENGINE_ARGS) as e:
        yield e


@pytest.fixture(scope="module")
def engine_url(chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One embedded engine process (tiny chat model) per test module (the HTTP path)."""
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with engine_server(chat_model_dir, log, **ENGINE_ARGS) as url:
        yield url


@pytest.fixture(scope="module")
def served(chat_model_dir: Path, engine: InProcEngine) -> Iterator[Served]:
    s = Served(chat_model_dir, engine)
    try:
        yield s
    finally:
        s.close()
