"""Test doubles for scheduling tests: a virtual-time event loop and an in-process engine.

The property test drives the controller through thousands of random schedules;
real engines would make that take hours, so generation here is simulated by an
object that implements the RolloutEngine protocol in-process (token by token
with virtual sleeps, pause/abort/continue, failures, health), and time is an
event loop whose clock jumps straight to the next timer.
"""

from __future__ import annotations

import asyncio
import random
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

from asyncrl.core import GenerateRequest, GenerateResult
from asyncrl.engines.rollout.base import EngineError, EngineUnavailable

T = TypeVar("T")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0


class _JumpSelector(selectors.BaseSelector):
    """A selector with no I/O: ``select(timeout)`` advances the virtual clock by ``timeout``."""

    def __init__(self, clock: _Clock):
        self._clock = clock
        self._map: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, id(fileobj), events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._map.pop(fileobj)

    def select(self, timeout: float | None = None) -> list:
        if timeout is None:
            raise RuntimeError("deadlock: nothing ready and no timer pending")
        self._clock.now += max(0.0, timeout)
        return []

    def get_map(self) -> dict:
        return self._map

    def close(self) -> None:
        self._map.clear()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is virtual: sleeps cost no wall time."""

    def __init__(self) -> None:
        self._vclock = _Clock()
        super().__init__(selector=_JumpSelector(self._vclock))

    def time(self) -> float:
        return self._vclock.now


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """``coro`` run to its end on a fresh :class:`VirtualTimeLoop` (closed after)."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


class FakeEngine:
    """An in-process RolloutEngine: one token per ``token_s`` of virtual time.

    ``pause_generation("abort")`` returns every in-flight request with its
    partial output (finish_reason ``abort``); ``in_place`` holds them; requests
    wait while paused. The reported version is the oldest one that produced a
    token of the request (as the embedded engine does). ``fail_p`` makes a
    request fail with EngineError; ``down()`` makes the engine unreachable.
    """

    def __init__(self, name: str, rng: random.Random, token_s: float, fail_p: float = 0.0):
        self.url = name
        self.rng = rng
        self.token_s = token_s
        self.fail_p = fail_p
        self.version = 0
        self.paused = False
        self.healthy = True
        self.epoch = 0
        self.requests = 0
        self.rids: set[str] = set()
        self._wake = asyncio.Event()

    def _poke(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> GenerateResult:
        if not self.healthy:
            raise EngineUnavailable(f"{self.url} is down")
        assert rid is not None and rid not in self.rids, f"duplicate rid {rid}"
        self.rids.add(rid)
        self.requests += 1
        budget = int(sampling_params["max_new_tokens"])
        assert budget > 0, "asked for 0 tokens"
        if self.rng.random() < self.fail_p:
            await asyncio.sleep(self.token_s)
            raise EngineError("/generate", 500, "injected failure")
        stop_at = budget if self.rng.random() < 0.5 else self.rng.randint(1, budget)
        epoch = self.epoch
        out: list[int] = []
        first_version: int | None = None
        while len(out) < min(budget, stop_at):
            while self.paused and self.epoch == epoch:
                await self._wake.wait()
            if self.epoch != epoch:
                break
            if not self.healthy:
                raise EngineUnavailable(f"{self.url} went down")
            await asyncio.sleep(self.token_s * (0.5 + self.rng.random()))
            if self.epoch != epoch:
                break
            if first_version is None:
                first_version = self.version
            out.append(len(input_ids) + len(out))
        if self.epoch != epoch:
            reason = "abort"
        else:
            reason = "length" if len(out) >= budget else "stop"
        version = self.version if first_version is None else first_version
        return GenerateResult(out, [-0.5] * len(out), version, reason)

    async def generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Items as concurrent requests, answered together once all finished; an item's
        failure fails the whole batch (one HTTP call)."""
        if not self.healthy:
            raise EngineUnavailable(f"{self.url} is down")
        out = await asyncio.gather(
            *(self.generate(r.input_ids, r.sampling_params, r.rid) for r in requests),
            return_exceptions=True,
        )
        for x in out:
            if isinstance(x, BaseException):
                raise x
        return out  # type: ignore[return-value] - no exceptions left

    async def pause_generation(self, mode: str = "abort") -> None:
        if not self.healthy:
            raise EngineUnavailable(f"{self.url} is down")
        self.paused = True
        if mode == "abort":
            self.epoch += 1
        self._poke()

    async def continue_generation(self) -> None:
        self.paused = False
        self._poke()

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.epoch += 1
        self._poke()

    async def get_weight_version(self) -> str:
        return str(self.version)

    async def health(self) -> bool:
        return self.healthy

    async def close(self) -> None:
        pass

    def down(self, for_s: float) -> None:
        """Unreachable for ``for_s`` seconds of loop time (in-flight requests fail)."""
        self.healthy = False
        self._poke()
        asyncio.get_running_loop().call_later(for_s, self._up)

    def _up(self) -> None:
        self.healthy = True
