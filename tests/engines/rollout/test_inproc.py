"""The in-process engine client answers as the engine server does over HTTP: one engine
process (``SGLangClient``) and one engine in this process (``InProcEngine``), same model,
seed and limits, the same requests in the same order: the same tokens, log-probs, per-token
versions, finish reasons and errors. Where the answer depends on when an abort or pause
lands, what does not depend on it is compared (token prefixes, version order)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from asyncrl.core import GenerateRequest, GenerateResult
from asyncrl.engines.rollout.base import EngineError
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.procs import free_port, python_env, stop
from tests.inproc import inproc_engine
from tests.runs import spawn_shared

LIMITS = {"seed": 3, "max_batch_size": 8, "context_length": 1000000}
LONG = 5000  # a budget no request finishes before the test aborts or pauses it
WAIT_S = 120.0  # for the engine's first tokens, however loaded the machine


def _res(r: GenerateResult) -> tuple[Any, ...]:
    return (r.output_ids, r.logprobs, r.token_versions(), r.finish_reason, r.prompt_tokens)


async def _tokens_at_least(engine: Any, n: int) -> None:
    """Until the engine generated ``n`` tokens in all (its own counter), bounded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while (await engine.get_server_info())["tokens"] < n:
        assert loop.time() < deadline, f"{engine.url} made no {n} tokens in {WAIT_S:g} s"
        await asyncio.sleep(0.01)


async def _refusal(coro: Any) -> tuple[str, int, str]:
    try:
        await coro
    except EngineError as exc:
        return (type(exc).__name__, exc.status, exc.message)
    raise AssertionError("accepted")


async def _script(engine: Any) -> dict[str, Any]:
    """Everything observable of one fixed sequence of calls (deterministic ones first: the
    sampling generator is shared by all requests, so order is part of the input)."""
    out: dict[str, Any] = {}
    await engine.update_weight_version("2")
    out["one"] = _res(await engine.generate([1, 5, 6, 7], {"max_new_tokens": 8}, rid="a"))
    sps = [{"max_new_tokens": 6, "temperature": 0.7, "top_p": 0.9}, {"max_new_tokens": 5}]
    sps.append({"max_new_tokens": 4, "temperature": 0.0, "stop_token_ids": [3]})
    ids = [[1, 2, 3], [1, 2, 3], [4, 5, 6, 7, 8]]
    batch = [GenerateRequest(i, sp, rid) for i, sp, rid in zip(ids, sps, "bcd", strict=True)]
    out["batch"] = [_res(r) for r in await engine.generate_batch(batch)]
    events = [r async for r in engine.generate_stream([2, 3, 4], {"max_new_tokens": 7})]
    for ev in events[:-1]:  # cumulative prefixes of the final answer, unfinished
        assert (
            ev.finish_reason == "" and ev.output_ids == events[-1].output_ids[: len(ev.output_ids)]
        )
    out["stream"] = _res(events[-1])
    out["zero"] = _res(await engine.generate([1, 2], {"max_new_tokens": 0}))
    out["refused"] = [
        await _refusal(engine.generate([1, 10**6], {"max_new_tokens": 2})),
        await _refusal(engine.generate([1, 2], {"temperature": "hot"})),
        await _refusal(engine.generate([1, 2], {"max_new_tokens": 2, "lora_path": "p-v1"})),
        await _refusal(
            engine.generate_batch([GenerateRequest([1], {}), GenerateRequest([1, 10**6], {})])
        ),
    ]
    # last, what depends on when a pause or an abort lands (timing): a long request, paused
    # in place, relabelled (version 3), continued, then aborted. Its tokens up to the shorter
    # run's are the same on both paths; each token's version is the one that ran its step
    start = (await engine.get_server_info())["tokens"]
    sp = {"max_new_tokens": LONG, "ignore_eos": True}
    task = asyncio.ensure_future(engine.generate([1, 5, 6], sp, rid="x"))
    await _tokens_at_least(engine, start + 3)
    await engine.pause_generation("in_place")
    await engine.update_weight_version("3")
    frozen = (await engine.get_server_info())["tokens"]
    await engine.continue_generation()
    await _tokens_at_least(engine, frozen + 3)
    await engine.abort_request("x")
    aborted = await asyncio.wait_for(task, WAIT_S)
    assert aborted.finish_reason == "abort" and 6 <= len(aborted.output_ids) < LONG
    vs = aborted.token_versions()
    assert vs == sorted(vs) and vs[0] == 2 and vs[-1] == 3, vs
    assert vs.count(2) == frozen - start  # nothing ran while paused
    out["aborted"] = aborted
    info = await engine.get_server_info()
    out["info"] = (sorted(info), info["weight_version"], info["paused"], info["num_requests"])
    return out


def test_inproc_engine_answers_as_the_http_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    args = ["-m", "asyncrl.entrypoints.engine", "--model-path", str(tiny_model_dir)]
    args += ["--port", str(port), "--threads", "1", "--seed", str(LIMITS["seed"])]
    args += ["--max-batch-size", "8", "--context-length", str(LIMITS["context_length"])]
    proc = spawn_shared(args, tmp_path / "engine.log", python_env())
    try:
        with inproc_engine(tiny_model_dir, **LIMITS) as local:

            async def both() -> tuple[dict[str, Any], dict[str, Any]]:
                http = SGLangClient(f"http://127.0.0.1:{port}")
                try:
                    await http.wait_healthy(WAIT_S)
                    await local.wait_healthy(WAIT_S)
                    return await _script(http), await _script(local)
                finally:
                    await http.close()

            remote, here = asyncio.run(both())
    finally:
        stop([proc])
    a, b = remote.pop("aborted"), here.pop("aborted")
    assert remote == here
    n = min(len(a.output_ids), len(b.output_ids))  # the same tokens up to the shorter
    assert a.output_ids[:n] == b.output_ids[:n] and a.logprobs[:n] == b.logprobs[:n]
    assert a.finish_reason == b.finish_reason == "abort"
    assert [r[:2] for r in here["refused"]] == [("EngineBadRequest", 400)] * 4
