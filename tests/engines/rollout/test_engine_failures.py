"""The embedded engine under failure: every request answered, limits before admission, a
prefill cancelled by its abort, health that sees a stuck step, KV sized to need."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from asyncrl.engines.rollout.launcher import (
    LOCAL_SERVER,
    LaunchSpec,
    launch,
    stop_servers,
    wait_healthy,
)
from asyncrl.engines.rollout.local.engine import LocalEngine, Request
from asyncrl.engines.rollout.local.sampling import SamplingParams
from asyncrl.procs import free_port
from asyncrl.secret import auth_headers
from tests.runs import spawn_shared

EOS = 2


def _model(layers: int = 2, positions: int = 64) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=positions,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def limited(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An engine server with the default limits (the tiny model's 64 positions)."""
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    spec = LaunchSpec(
        str(tiny_model_dir), free_port(), extra_args=("--threads", "1"), module=LOCAL_SERVER
    )
    server = launch(spec, log, spawner=spawn_shared)
    try:
        asyncio.run(wait_healthy([server], timeout_s=120))
        yield server.url
    finally:
        stop_servers([server])


@pytest.fixture
def stopping() -> Iterator[list[LocalEngine]]:
    engines: list[LocalEngine] = []
    yield engines
    for e in engines:
        e.stop()


def _request(ids: list[int], rid: str, **sp: Any) -> Request:
    loop = asyncio.get_running_loop()
    return Request(rid, ids, SamplingParams(**sp), loop, loop.create_future())


async def test_a_failing_prefill_answers_its_requests_and_the_batch_goes_on(
    stopping: list[LocalEngine],
) -> None:
    """Prefill raising (out of memory on a long prompt, here injected at the embedding) ends
    each of its requests with an abort that names the error; the running batch finishes."""
    model = _model(positions=4096)

    def oom(_: Any, args: tuple[Any, ...]) -> None:
        if args[0].shape[-1] > 40:
            raise RuntimeError("out of memory (injected)")

    model.get_input_embeddings().register_forward_pre_hook(oom)
    engine = LocalEngine(model, {EOS}, max_batch_size=4)
    stopping.append(engine)
    running = _request([1, 3, 4], "short", max_new_tokens=400, ignore_eos=True, temperature=0)
    engine.submit(running)
    deadline = time.monotonic() + 20
    while not running.output_ids and time.monotonic() < deadline:  # it runs: decoding
        await asyncio.sleep(0.001)
    long = [_request([5] * 50, f"long{i}", max_new_tokens=4) for i in range(2)]
    engine.submit_all(long)
    done = await asyncio.wait_for(asyncio.gather(*(r.future for r in long)), 20)
    for r in done:
        assert r.finish["type"] == "abort" and "out of memory" in r.finish["message"], r.finish
    ok = await asyncio.wait_for(running.future, 60)  # a loaded box decodes slowly
    assert ok.finish["type"] == "length" and len(ok.output_ids) == 400
    assert engine.num_requests == 0


async def test_abort_cancels_the_prefill_in_progress(stopping: list[LocalEngine]) -> None:
    """A client that hangs up aborts its request; a prefill in progress stops at its next
    decoder layer instead of running to the end (12 slow layers here)."""
    model = _model(layers=12)
    calls: list[int] = []
    started = threading.Event()

    def slow(_: Any, args: tuple[Any, ...]) -> None:
        if args[0].shape[1] > 1:  # prefill only
            calls.append(1)
            started.set()
            time.sleep(0.1)

    for layer in model.model.layers:
        layer.register_forward_pre_hook(slow)
    engine = LocalEngine(model, {EOS}, max_batch_size=4)
    stopping.append(engine)
    req = _request([1] + [3] * 20, "victim", max_new_tokens=5)
    engine.submit(req)
    assert await asyncio.to_thread(started.wait, 20)
    assert await asyncio.to_thread(engine.abort, "victim") == 1
    out = await asyncio.wait_for(req.future, 20)
    assert out.finish["type"] == "abort" and out.output_ids == []
    assert len(calls) < 12, f"the prefill ran {len(calls)} of 12 layers after its abort"
    # the engine goes on serving
    nxt = _request([1, 3], "next", max_new_tokens=3, ignore_eos=True)
    engine.submit(nxt)
    assert len((await asyncio.wait_for(nxt.future, 20)).output_ids) == 3


async def test_health_reports_a_step_that_runs_too_long(stopping: list[LocalEngine]) -> None:
    model = _model()
    go = threading.Event()
    entered = threading.Event()

    def stuck(_: Any, args: tuple[Any, ...]) -> None:
        if args[0].shape[-1] > 10:
            entered.set()
            go.wait(30)

    model.get_input_embeddings().register_forward_pre_hook(stuck)
    engine = LocalEngine(model, {EOS}, max_batch_size=4, stall_s=0.2)
    stopping.append(engine)
    assert engine.health() is None
    req = _request([4] * 20, "stuck", max_new_tokens=2)
    engine.submit(req)
    try:
        assert await asyncio.to_thread(entered.wait, 20)
        deadline = time.monotonic() + 10
        while engine.health() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        problem = engine.health()
        assert problem is not None and "scheduler step" in problem, problem
    finally:
        go.set()
    await asyncio.wait_for(req.future, 20)
    assert engine.health() is None


async def test_kv_cache_of_one_long_prompt_is_sized_to_it(stopping: list[LocalEngine]) -> None:
    """One 3,000-token prompt's cache costs at most ~2x its own keys/values (it cost 65 rows
    of spare capacity and twice its width before)."""
    model = _model(layers=2, positions=4096)
    engine = LocalEngine(model, {EOS}, max_batch_size=256, max_prefill_tokens=8192)
    stopping.append(engine)
    req = _request([3] * 3000, "long", max_new_tokens=2, ignore_eos=True)
    engine.submit(req)
    await asyncio.wait_for(req.future, 60)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    need = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 3002 * head_dim * 4
    assert need <= engine.stats["kv_bytes_peak"] <= 2.5 * need, (engine.stats, need)


async def _post(url: str, path: str, body: Any) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession(headers=auth_headers()) as http,
        http.post(url + path, json=body) as resp,
    ):
        return resp.status, await resp.json(content_type=None)


@pytest.mark.parametrize(
    ("prompt", "sampling", "reason"),
    [
        (65, {"max_new_tokens": 1}, "max_prompt_tokens"),
        (10, {"max_new_tokens": 3000}, "context length"),
        (10, {"max_new_tokens": 55}, "context length"),
        (10, {"max_new_tokens": 1e400}, "max_new_tokens"),
    ],
)
def test_requests_over_the_context_get_400_before_admission(
    limited: str, prompt: int, sampling: dict, reason: str
) -> None:
    """The tiny model has 64 positions: a request that cannot fit is refused with the reason."""
    body = {"input_ids": [3] * prompt, "sampling_params": sampling}
    status, out = asyncio.run(_post(limited, "/generate", body))
    assert status == 400 and reason in out["error"]["message"], (status, out)


def test_unset_max_new_tokens_is_clipped_to_the_context(limited: str) -> None:
    body = {"input_ids": [3] * 60, "sampling_params": {"temperature": 0, "ignore_eos": True}}
    status, out = asyncio.run(_post(limited, "/generate", body))
    assert status == 200 and out["meta_info"]["completion_tokens"] == 4, out
    body["sampling_params"]["max_new_tokens"] = 4  # exactly the context: allowed
    status, out = asyncio.run(_post(limited, "/generate", body))
    assert status == 200 and out["meta_info"]["completion_tokens"] == 4, out


def test_server_health_is_200_when_idle(limited: str) -> None:
    async def get() -> tuple[int, str]:
        async with (
            aiohttp.ClientSession(headers=auth_headers()) as http,
            http.get(limited + "/health") as r,
        ):
            return r.status, await r.text()

    assert asyncio.run(get()) == (200, "ok")
