"""Router (asyncrl/controllers/router.py) over real clients: a live engine server and a dead URL."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.controllers.router import Router
from asyncrl.engines.rollout.base import EngineBadRequest, EngineError, EngineUnavailable
from asyncrl.engines.rollout.launcher import LaunchedServer
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.procs import free_port


async def test_least_outstanding_and_health(engine_server: LaunchedServer) -> None:
    live = SGLangClient(engine_server.url)
    dead = SGLangClient(f"http://127.0.0.1:{free_port()}", timeout_s=5)
    router = Router([live, dead], max_consecutive_errors=2)
    try:
        assert {router.pick(), router.pick()} == {live, dead}  # ties spread round-robin
        long = {"max_new_tokens": 100_000, "ignore_eos": True}
        running = asyncio.create_task(router.call(live, [1, 3], long, "busy"))
        while router.outstanding[id(live)] != 1:  # counted once the call task runs
            await asyncio.sleep(0.01)
        assert all(router.pick() is dead for _ in range(4))  # fewest in flight
        with pytest.raises(EngineUnavailable):
            await router.call(dead, [1, 3], {"max_new_tokens": 2}, "x")
        router.report_failure(dead, EngineUnavailable("down"))
        assert id(dead) in router.unhealthy and router.failures == 1
        assert router.pick() is live  # the only engine in rotation, busy or not
        await router.probe()
        assert id(dead) in router.unhealthy  # still down
        await live.abort_request("busy")
        assert (await running).finish_reason == "abort"
        assert router.outstanding[id(live)] == 0 and router.served[id(live)] == 1
        router.report_failure(live, EngineBadRequest("/generate", 400, "bad"))
        router.report_failure(live, EngineError("/generate", 500, "oops"))
        assert id(live) not in router.unhealthy  # a bad request is not the engine's fault
        router.report_failure(live, EngineError("/generate", 500, "oops"))
        assert id(live) in router.unhealthy  # 2 server errors in a row
        with pytest.raises(EngineUnavailable, match="no healthy"):
            router.pick()
        await router.probe()
        assert router.pick() is live  # back in rotation once /health answers
        assert router.stats()[live.url]["healthy"]
    finally:
        await asyncio.gather(live.close(), dead.close())
    with pytest.raises(ValueError, match="at least one"):
        Router([])


async def test_membership_join_hold_admit_and_leave(engine_server: LaunchedServer) -> None:
    """An engine that joins held (not yet re-synced) gets no request though /health answers;
    admitted, it does; one that leaves mid-request gets no more and its request completes."""
    first = SGLangClient(engine_server.url)
    router = Router([first])
    joined = SGLangClient(engine_server.url)  # the same server under a second client
    try:
        router.add(joined, held=True)
        with pytest.raises(ValueError, match="already routed"):
            router.add(joined)
        await router.probe()
        assert all(router.pick() is first for _ in range(4))  # held: /health is not enough
        router.admit(joined)
        assert {router.pick(), router.pick()} == {first, joined}
        router.hold(first)
        assert all(router.pick() is joined for _ in range(3))
        router.admit(first)
        busy = asyncio.create_task(router.call(first, [1, 3], {"max_new_tokens": 4}, "r1"))
        await asyncio.sleep(0)
        router.remove(first)  # leaves with a request in flight
        assert all(router.pick() is joined for _ in range(4))
        assert router.find(engine_server.url) is joined
        assert len((await busy).output_ids) > 0  # ran out normally, accounting unharmed
        assert set(router.outstanding) == {id(joined)}
        with pytest.raises(ValueError, match="not routed"):
            router.remove(first)
    finally:
        await first.close()
        await joined.close()
