"""The SGLang client against the embedded engine as a real server process (one client, tested
for real): generate, log-probs, abort, pause/continue, weight update, version, typed errors."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from asyncrl.core import GenerateRequest
from asyncrl.engines.rollout.base import (
    BucketAnnouncement,
    EngineBadRequest,
    EngineError,
    EngineUnavailable,
)
from asyncrl.engines.rollout.launcher import LaunchedServer
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.procs import free_port

LONG = {"max_new_tokens": 100_000, "ignore_eos": True}


async def _until(client: SGLangClient, what: str, ok, timeout_s: float = 120.0) -> dict:
    """Poll the engine's ``/get_server_info`` until ``ok(info)``; fails naming ``what``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        info = await client.get_server_info()
        if ok(info):
            return info
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"engine: {what} not seen within {timeout_s:g}s: {info}")
        await asyncio.sleep(0.01)


async def _started(client: SGLangClient, task: asyncio.Task, n: int = 1) -> None:
    """Wait until the engine holds ``n`` requests and has generated for them."""
    base = int((await client.get_server_info())["tokens"])
    await _until(
        client, f"{n} request(s) decoding", lambda i: i["num_requests"] >= n and i["tokens"] > base
    )
    assert not task.done(), "the request finished too early"


async def test_generate_with_logprobs_and_version(engine_server: LaunchedServer) -> None:
    client = SGLangClient(engine_server.url)
    try:
        res = await client.generate([1, 3, 4, 5], {"max_new_tokens": 8, "temperature": 1.0})
        assert 1 <= len(res.output_ids) <= 8 and len(res.logprobs) == len(res.output_ids)
        assert all(lp <= 0 and math.isfinite(lp) for lp in res.logprobs)
        assert res.finish_reason in ("stop", "length") and res.prompt_tokens == 4
        assert res.weight_version == int(await client.get_weight_version())
        greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
        a = await client.generate([1, 3, 4], greedy, rid="g1")
        b = await client.generate([1, 3, 4], greedy, rid="g2")
        assert a.output_ids == b.output_ids and a.finish_reason == "length"
    finally:
        await client.close()


async def test_batched_generate_answers_each_item_in_order(engine_server: LaunchedServer) -> None:
    """SGLang's list form: per-item sampling params and rids, answers in order, each equal to
    the item sent alone (greedy); malformed batches are rejected with HTTP 400."""
    client = SGLangClient(engine_server.url)
    try:
        greedy = {"temperature": 0, "ignore_eos": True}
        prompts = [[1, 3, 4, 5], [1, 3, 4, 5], [1, 9], [1, 3, 4, 5]]
        params = [{**greedy, "max_new_tokens": n} for n in (7, 3, 5, 1)]
        items = zip(prompts, params, ["i0", "i1", "i2", "i3"], strict=True)
        batch = await client.generate_batch([GenerateRequest(*item) for item in items])
        alone = [await client.generate(p, sp) for p, sp in zip(prompts, params, strict=True)]
        assert [len(b.output_ids) for b in batch] == [7, 3, 5, 1]
        for b, a in zip(batch, alone, strict=True):
            assert b.output_ids == a.output_ids and b.finish_reason == "length"
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        shared = await client._call(
            "POST", "/generate", {"input_ids": prompts[:2], "sampling_params": params[0]}
        )
        assert [len(x["output_ids"]) for x in shared] == [7, 7]
        for bad in ({"rid": "one"}, {"rid": ["a"]}, {"sampling_params": [params[0]]}):
            with pytest.raises(EngineBadRequest):
                await client._call("POST", "/generate", {"input_ids": prompts[:2], **bad})
    finally:
        await client.close()


async def test_abort_one_and_all(engine_server: LaunchedServer) -> None:
    client = SGLangClient(engine_server.url)
    try:
        one = asyncio.create_task(client.generate([1, 3], LONG, rid="abort-me"))
        other = asyncio.create_task(client.generate([1, 4], LONG, rid="keep-me"))
        await _started(client, one, n=2)
        await client.abort_request("abort-me")
        res = await one
        assert res.finish_reason == "abort" and len(res.logprobs) == len(res.output_ids)
        assert not other.done()
        await client.abort_request(abort_all=True)
        assert (await other).finish_reason == "abort"
    finally:
        await client.close()


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_keeps_and_continue_resumes(engine_server: LaunchedServer, mode: str) -> None:
    client = SGLangClient(engine_server.url)

    async def tokens() -> int:
        return int((await client.get_server_info())["tokens"])

    try:
        task = asyncio.create_task(client.generate([1, 5], LONG, rid=mode))
        await _started(client, task)
        await client.pause_generation(mode)
        frozen = await tokens()
        # no quiet window: a request sent after the pause reaches the engine (counted) and is
        # held, and nothing was generated meanwhile; both go on after continue
        later = asyncio.create_task(
            client.generate([1, 7], {"max_new_tokens": 3, "ignore_eos": True}, rid=mode + "+")
        )
        info = await _until(client, "the later request queued", lambda i: i["num_requests"] == 2)
        assert info["paused"] and int(info["tokens"]) == frozen
        assert not task.done() and not later.done()  # kept, not generating
        await client.continue_generation()
        await _until(client, "generation resumed", lambda i: int(i["tokens"]) > frozen)
        assert (await asyncio.wait_for(later, 60)).finish_reason == "length"
        await client.abort_request(mode)
        res = await asyncio.wait_for(task, 60)
        assert res.finish_reason == "abort" and len(res.output_ids) > 0
    finally:
        await client.continue_generation()
        await client.close()


async def test_pause_abort_returns_in_flight_and_queues_new(engine_server: LaunchedServer) -> None:
    client = SGLangClient(engine_server.url)
    try:
        task = asyncio.create_task(client.generate([1, 6], LONG, rid="pa"))
        await _started(client, task)
        await client.pause_generation("abort")
        assert (await asyncio.wait_for(task, 30)).finish_reason == "abort"
        queued = asyncio.create_task(client.generate([1, 6], {"max_new_tokens": 3}))
        await _until(client, "the new request queued", lambda i: i["num_requests"] == 1)
        assert not queued.done() and (await client.get_server_info())["paused"]
        await client.continue_generation()
        assert (await asyncio.wait_for(queued, 30)).finish_reason in ("stop", "length")
    finally:
        await client.continue_generation()
        await client.close()


async def test_weight_update_and_version(engine_server: LaunchedServer, weight_pusher) -> None:
    client = SGLangClient(engine_server.url)
    try:
        await weight_pusher.connect(client)
        zeroed = dict(weight_pusher.original)
        zeroed["lm_head.weight"] = torch.zeros_like(zeroed["lm_head.weight"])
        await weight_pusher.push(client, zeroed, "5")
        assert await client.get_weight_version() == "5"
        res = await client.generate([1, 3], {"max_new_tokens": 4, "ignore_eos": True})
        vocab = zeroed["lm_head.weight"].shape[0]
        assert res.weight_version == 5
        assert res.logprobs == pytest.approx([-math.log(vocab)] * 4, abs=1e-5)  # uniform
        await weight_pusher.push(client, weight_pusher.original, "6")
        res = await client.generate([1, 3], {"max_new_tokens": 4, "ignore_eos": True})
        assert res.weight_version == 6 and res.logprobs != pytest.approx([-math.log(vocab)] * 4)
        await client.update_weight_version("7")
        assert await client.get_weight_version() == "7"
        await client.flush_cache()
    finally:
        await client.update_weight_version("0")
        await client.close()


async def test_errors_are_typed_and_carry_the_server_message(
    engine_server: LaunchedServer,
) -> None:
    client = SGLangClient(engine_server.url)
    try:
        with pytest.raises(EngineBadRequest, match="input_ids") as bad:
            await client.generate([1, 10**9], {})
        assert bad.value.status == 400 and "input_ids" in bad.value.message
        with pytest.raises(EngineBadRequest, match="temprature"):
            await client.generate([1, 3], {"temprature": 0.5})
        with pytest.raises(EngineBadRequest, match="init_weights_update_group"):
            bucket = BucketAnnouncement(["x"], ["float32"], [[1]], "no-group")
            await client.update_weights_from_distributed(bucket)
        with pytest.raises(ValueError, match="pause mode"):
            await client.pause_generation("sideways")
        assert await client.health()
    finally:
        await client.close()
    dead = SGLangClient(f"http://127.0.0.1:{free_port()}", timeout_s=5)
    try:
        with pytest.raises(EngineUnavailable):
            await dead.generate([1, 3], {})
        assert not await dead.health()
        with pytest.raises(EngineUnavailable, match=r"did not answer within 0\.3s \(last: "):
            await dead.wait_healthy(0.3, interval_s=0.1)
    finally:
        await dead.close()
    assert issubclass(EngineBadRequest, EngineError)
