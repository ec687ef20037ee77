"""asyncrl's SGLang client streaming (``generate_stream``) against SGLang as it streams.

The other side is the stand-in (``tests/engines/rollout/sglang/standin.py``), whose
streamed ``/generate`` is written from SGLang's http_server.py and tokenizer_manager.py
(file:line cited there): cumulative events, ``finish_reason`` null until the last,
``data: [DONE]`` last, errors as an event, a hung-up reader's request aborted 2 s after.
One stand-in per version for the module (0.5.10, and 0.5.23 with version spans).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from asyncrl.engines.rollout.base import EngineBadRequest
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.secret import auth_headers
from tests.engines.rollout.sglang.code import sglang_src
from tests.engines.rollout.sglang.server import StandInServer, start_standin

LONG = {"max_new_tokens": 100_000, "ignore_eos": True}


@pytest.fixture(scope="module", params=["0.5.10", "0.5.23"])
def standin(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[StandInServer]:
    sglang_src(request.param)
    folder = tmp_path_factory.mktemp(f"sglang-{request.param}")
    server = start_standin(request.param, tiny_model_dir, folder, step_s=0.01)
    try:
        yield server
    finally:
        server.stop()


async def _until(server: StandInServer, what: str, ok, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        st = await asyncio.to_thread(server.state)
        if ok(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"SGLang stand-in: {what} not seen within {timeout_s:g}s")
        await asyncio.sleep(0.02)


async def test_events_grow_and_the_last_is_the_whole_answer(standin: StandInServer) -> None:
    c = SGLangClient(standin.url)
    try:
        sp = {"max_new_tokens": 12, "ignore_eos": True}
        events = [r async for r in c.generate_stream([1, 3, 4], sp, rid="st-grow")]
    finally:
        await c.close()
    assert len(events) > 2  # streamed, not one answer at the end
    *partial, last = events
    assert all(e.finish_reason == "" for e in partial) and last.finish_reason == "length"
    for a, b in itertools.pairwise(events):  # cumulative: each extends the one before
        assert len(b.output_ids) > len(a.output_ids) or b is last
        assert b.output_ids[: len(a.output_ids)] == a.output_ids
        assert b.logprobs[: len(a.logprobs)] == a.logprobs
    assert len(last.output_ids) == len(last.logprobs) == 12 and last.prompt_tokens == 3
    truth = (await asyncio.to_thread(standin.state))["reqs"]["st-grow"]["truth"]
    assert last.token_versions() == truth


async def test_the_wire_framing(standin: StandInServer) -> None:
    """What the client parses, as SGLang frames it (hs:664-681 in 0.5.10)."""
    body = {"input_ids": [1, 3, 4], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    body |= {"stream": True, "return_logprob": True}
    async with (
        aiohttp.ClientSession(headers=auth_headers()) as http,
        http.post(standin.url + "/generate", json=body) as r,
    ):
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.read()
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    datas = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert [d["meta_info"]["finish_reason"] is None for d in datas][-1] is False
    assert all(d["meta_info"]["finish_reason"] is None for d in datas[:-1])
    assert [len(d["output_ids"]) for d in datas] == list(range(1, 5))


async def test_a_reader_that_hangs_up_has_its_request_aborted(standin: StandInServer) -> None:
    c = SGLangClient(standin.url)
    try:
        stream = c.generate_stream([1, 3, 4], LONG, rid="st-cut")
        first = await stream.__anext__()
        assert first.output_ids and first.finish_reason == ""
        await stream.aclose()
        st = await _until(
            standin, "the hung-up request aborted", lambda s: s["reqs"]["st-cut"]["finish"]
        )
        assert st["reqs"]["st-cut"]["finish"] == "abort"
    finally:
        await c.close()


async def test_pause_abort_ends_the_stream_with_its_tokens(standin: StandInServer) -> None:
    c = SGLangClient(standin.url)
    try:
        seen: list[int] = []

        async def read() -> list:
            out = []
            async for r in c.generate_stream([1, 3, 4], LONG, rid="st-pause"):
                out.append(r)
                seen.append(len(r.output_ids))
            return out

        task = asyncio.ensure_future(read())
        await _until(
            standin,
            "the stream decoding",
            lambda s: len(s["reqs"].get("st-pause", {}).get("truth", [])) >= 3,
        )
        await c.pause_generation("abort")
        events = await asyncio.wait_for(task, 30)
        last = events[-1]
        assert last.finish_reason == "abort" and len(last.output_ids) == seen[-1] >= 3
        assert len(last.logprobs) == len(last.output_ids)
        await c.continue_generation()
        res = await c.generate([1, 3, 4], {"max_new_tokens": 2, "ignore_eos": True})
        assert len(res.output_ids) == 2
    finally:
        await c.close()


async def test_an_error_while_streaming_is_raised(standin: StandInServer) -> None:
    """A rid already in flight: SGLang's ValueError, as an error event (stream) or a 400."""
    c = SGLangClient(standin.url)
    try:
        stream = c.generate_stream([1, 3, 4], LONG, rid="st-dup")
        await stream.__anext__()
        with pytest.raises(EngineBadRequest, match="Duplicate request ID"):
            async for _ in c.generate_stream([1, 3], LONG, rid="st-dup"):
                pass
        with pytest.raises(EngineBadRequest, match="Duplicate request ID"):
            await c.generate([1, 3], {"max_new_tokens": 2}, rid="st-dup")
        await c.abort_request("st-dup")
        rest = [r async for r in stream]
        assert rest[-1].finish_reason == "abort"
    finally:
        await c.close()
