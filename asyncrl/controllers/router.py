"""Routing of generation requests across engines: least outstanding requests, health-aware.

An engine that fails a request is taken out of rotation; a background health
probe (run by the controller) puts it back once ``/health`` answers again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from asyncrl.engines.rollout.base import EngineUnavailable, GenerateResult, RolloutEngine

__all__ = ["Router"]

log = logging.getLogger(__name__)


class Router:
    def __init__(self, engines: Sequence[RolloutEngine]):
        if not engines:
            raise ValueError("at least one rollout engine is needed")
        self.engines = list(engines)
        self.outstanding = {id(e): 0 for e in self.engines}
        self.unhealthy: set[int] = set()
        self.failures = 0

    def pick(self) -> RolloutEngine:
        """The healthy engine with the fewest requests in flight."""
        healthy = [e for e in self.engines if id(e) not in self.unhealthy]
        if not healthy:
            raise EngineUnavailable("no healthy rollout engine")
        return min(healthy, key=lambda e: self.outstanding[id(e)])

    async def call(
        self, engine: RolloutEngine, input_ids: list[int], params: dict[str, Any], rid: str
    ) -> GenerateResult:
        self.outstanding[id(engine)] += 1
        try:
            return await engine.generate(input_ids, params, rid=rid)
        finally:
            self.outstanding[id(engine)] -= 1

    def report_failure(self, engine: RolloutEngine | None, exc: Exception) -> None:
        self.failures += 1
        if engine is not None and isinstance(exc, EngineUnavailable):
            if id(engine) not in self.unhealthy:
                log.warning("engine %s out of rotation: %s", getattr(engine, "url", "?"), exc)
            self.unhealthy.add(id(engine))

    async def probe(self) -> None:
        """Put engines that answer /health back into rotation."""
        for e in self.engines:
            if id(e) in self.unhealthy and await e.health():
                log.info("engine %s back in rotation", getattr(e, "url", "?"))
                self.unhealthy.discard(id(e))
