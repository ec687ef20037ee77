"""Requests in flight on a stand-in while the test pushes weights or adapters to it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from asyncrl.core import GenerateResult


def generate_in_background(
    client: Callable[[], Any],
    requests: list[tuple[str, list[int], dict[str, Any]]],
    started: Callable[[], bool],
    what: str,
    timeout_s: float = 60.0,
) -> tuple[threading.Thread, dict[str, GenerateResult]]:
    """Send ``requests`` (rid, prompt, sampling params) at once through one client from
    ``client`` on a thread of its own; return once ``started()`` holds (else fail naming
    ``what``): the thread (join it) and the results by rid, filled when all finished."""
    results: dict[str, GenerateResult] = {}

    async def generate() -> None:
        c = client()
        try:
            calls = (c.generate(ids, sp, rid=rid) for rid, ids, sp in requests)
            out = await asyncio.gather(*calls)
            results.update(zip([rid for rid, _, _ in requests], out, strict=True))
        finally:
            await c.close()

    t = threading.Thread(target=lambda: asyncio.run(generate()))
    t.start()
    deadline = time.monotonic() + timeout_s
    while not started():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s}s"
        time.sleep(0.05)
    return t, results


def check_versions(results: dict[str, GenerateResult], reqs: dict[str, Any]) -> None:
    """Every result's per-token versions are what the stand-in recorded for its rid
    (``reqs[rid]["truth"]``), and at least one request spanned a push."""
    spanned = 0
    for rid, res in results.items():
        truth = reqs[rid]["truth"]
        assert res.token_versions() == truth, (rid, res.versions, truth)
        spanned += len(set(truth)) > 1
    assert spanned, "no request spanned a push"
