"""Identical requests started together (a GRPO group's samples of one prompt) travel to the
engine as one batched /generate; each episode still gets exactly its own generation, a
failed batch counts once against the engine, and abandoned batches are aborted. These and the
multi-turn tool example (a controller and a weight push driving an engine process) are the
controller's path end to end over a real engine process and HTTP; the other controller tests
generate with an engine in the test process (tests/inproc.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import aiohttp

from asyncrl.controllers.episode import EpisodeContext, Gate
from asyncrl.controllers.router import Router
from asyncrl.engines.rollout.base import EngineError
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.procs import free_port
from asyncrl.secret import auth_headers

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [1, 5, 6, 7, 14, 3]
GREEDY = {"temperature": 0, "ignore_eos": True}


async def _server_info(url: str) -> dict:
    async with (
        aiohttp.ClientSession(headers=auth_headers()) as http,
        http.get(url + "/get_server_info") as resp,
    ):
        return await resp.json()


async def _group(router: Router, lengths: list[int], prompt: list[int] = PROMPT) -> list:
    ctxs = [EpisodeContext(router, 0, i, GREEDY, 1, Gate()) for i in range(len(lengths))]
    return await asyncio.gather(
        *(c.generate(prompt, max_new_tokens=n) for c, n in zip(ctxs, lengths, strict=True))
    )


async def test_group_travels_as_one_batch_with_exact_results(engine_url: str) -> None:
    lengths = [9, 2, 30, 5, 1, 12]
    client = SGLangClient(engine_url, record=True)
    try:
        await client.update_weight_version("3")
        shared_before = (await _server_info(engine_url))["prefill_shared"]
        batched, other = await asyncio.gather(
            _group(Router([client], batch_identical=True), lengths),
            _group(Router([client], batch_identical=True), [4], [1, 9, 9]),
        )
        assert client.sent is not None
        generates = [body for _, path, body in client.sent if path == "/generate"]
        assert sorted(len(b["rid"]) if isinstance(b["rid"], list) else 1 for b in generates) == [
            1,
            len(lengths),
        ]
        assert (await _server_info(engine_url))["prefill_shared"] - shared_before >= 5
        alone = await _group(Router([client]), lengths)  # one request each
        assert len(client.sent) == 2 + 1 + len(lengths)  # (version update first)
    finally:
        await client.close()
    for b, a, n in zip(batched, alone, lengths, strict=True):
        assert b.output_ids == a.output_ids and len(b.output_ids) == n
        assert b.versions == [3] * n and b.finish_reason == "length"
        assert all(abs(x - y) < 1e-5 for x, y in zip(b.logprobs, a.logprobs, strict=True))
    assert len(other[0].output_ids) == 4


async def test_failed_batch_counts_once_and_each_episode_retries(engine_url: str) -> None:
    dead = SGLangClient(f"http://127.0.0.1:{free_port()}", timeout_s=5)
    live = SGLangClient(engine_url)
    router = Router([dead, live], max_consecutive_errors=2, batch_identical=True)
    try:
        ctxs = [EpisodeContext(router, 0, i, GREEDY, 2, Gate()) for i in range(4)]
        for c in ctxs:
            c._engine = dead  # the group starts on the engine that is down
        gens = await asyncio.gather(*(c.generate(PROMPT, max_new_tokens=3) for c in ctxs))
        assert [len(g.output_ids) for g in gens] == [3] * 4
        assert router.failures == 4 and id(dead) in router.unhealthy
    finally:
        await dead.close()
        await live.close()
    # a server error shared by a batch's calls is one strike, not one per call
    router = Router([live], max_consecutive_errors=2)
    err = EngineError("/generate", 500, "boom")
    for _ in range(3):
        router.report_failure(live, err)
    assert not router.unhealthy and router.failures == 3
    router.report_failure(live, EngineError("/generate", 500, "again"))
    assert router.unhealthy == {id(live)}


async def _running(engine_url: str, n: int) -> bool:
    """Whether the engine reaches ``n`` requests in flight within ~5 s."""
    for _ in range(500):
        if (await _server_info(engine_url))["num_requests"] == n:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_abandoned_batch_is_aborted_on_the_engine(engine_url: str) -> None:
    client = SGLangClient(engine_url)
    router = Router([client], batch_identical=True)
    try:
        task = asyncio.ensure_future(_group(router, [100_000] * 3))
        assert await _running(engine_url, 3), "the batch never reached the engine"
        task.cancel()
        assert await _running(engine_url, 0), "the abandoned batch kept generating"
        assert task.cancelled()
    finally:
        await client.close()


def _example():
    spec = importlib.util.spec_from_file_location("tool_episode", ROOT / "examples/tool_episode.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tool_episode"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_example_multi_turn_tool_episode(engine_url: str, tiny_model_dir: Path) -> None:
    stats = asyncio.run(_example().drive(engine_url, str(tiny_model_dir), 3, 2, 3))
    assert stats["trained"] == 6 and stats["version"] == 3 and stats["failed"] == 0
    assert stats["groups_admitted"] == (
        stats["trained"]
        + stats["ready"]
        + stats["running"]
        + stats["rejected"]
        + stats["stale_dropped"]
        + stats["stale_regenerated"]
    )
