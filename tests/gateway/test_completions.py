"""``/v1/completions`` and a weight update landing mid-stream: one uninterrupted stream,
per-token versions exact."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
import openai

from .conftest import Served, gateway_auth


def test_weight_update_mid_stream_keeps_tokens_and_versions(served: Served) -> None:
    # The update is made at the stream's 5th chunk; on a loaded machine the engine may have
    # generated all 120 tokens by then (nothing left to abort): such a try shows nothing
    # and is made again, with a new session (at most 3 tries).
    for _ in range(3):
        snap, text, usage, before = _stream_with_update(served)
        (b,) = snap["branches"]
        if before + 1 in b["versions"][b["prompt_len"] :]:
            break
    assert usage == 120
    out = b["token_ids"][b["prompt_len"] :]
    vers = b["versions"][b["prompt_len"] :]
    assert len(out) == 120 and all(b["loss_mask"][b["prompt_len"] :])
    assert served.gw.tok.decode(out) == text
    k = vers.index(before + 1)
    assert 0 < k and vers == [before] * k + [before + 1] * (120 - k)
    # the engine's own answers: an aborted call, then the rest resubmitted
    calls = [(i, r) for _, i, r in served.engine.results[-2:]]
    assert calls[0][1].finish_reason == "abort"
    assert calls[0][1].output_ids + calls[1][1].output_ids == out


def _stream_with_update(served: Served) -> tuple[dict[str, Any], str, int, int]:
    """One streamed 120-token completion in a new session, a weight update made at its
    5th chunk; the session's snapshot, the text, the usage's tokens, the version before."""
    sid = uuid.uuid4().hex[:12]
    base = f"{served.url}/sessions/{sid}/v1"
    ctl, engine = served.ctl, served.engine

    async def go() -> tuple[str, int]:
        client = openai.AsyncOpenAI(base_url=base, api_key=served.key)
        stream = await client.completions.create(
            model="t",
            prompt="Hello",
            max_tokens=120,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage, chunks = "", 0, 0
        async for chunk in stream:
            chunks += 1
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            text += "".join(c.text for c in chunk.choices)
            if chunks == 5:  # a weight update lands mid-stream
                v = ctl.staleness.version + 1
                async with ctl.weight_update(v, mode="abort"):
                    await engine.client.update_weight_version(str(v))
        await client.close()
        return text, usage

    before = ctl.staleness.version
    text, usage = served.run(go())
    return served.run(_get(f"{served.url}/sessions/{sid}")), text, usage, before


def test_completion_turns_extend_one_branch(served: Served) -> None:
    sid = uuid.uuid4().hex[:12]
    client = openai.OpenAI(base_url=f"{served.url}/sessions/{sid}/v1", api_key=served.key)
    r1 = client.completions.create(model="t", prompt="Hi", max_tokens=6, logprobs=1)
    assert r1.choices[0].logprobs is not None and len(r1.choices[0].logprobs.tokens or []) <= 6
    client.completions.create(model="t", prompt="Hi" + r1.choices[0].text + " more", max_tokens=6)
    snap = served.run(_get(f"{served.url}/sessions/{sid}"))
    (b,) = snap["branches"]
    assert b["turns"] == 2


def test_reward_ends_the_session_into_a_trajectory(served: Served) -> None:
    sid = uuid.uuid4().hex[:12]
    client = openai.OpenAI(base_url=f"{served.url}/sessions/{sid}/v1", api_key=served.key)
    client.completions.create(model="t", prompt="Hi", max_tokens=4)

    async def reward() -> Any:
        async with aiohttp.ClientSession(headers=gateway_auth()) as http:
            url = f"{served.url}/sessions/{sid}/reward"
            async with http.post(url, json={"reward": 0.5}) as r:
                return r.status

    assert served.run(reward()) == 200

    async def trained() -> Any:
        for _ in range(200):
            for batch in served.batches:
                for t in batch.trajectories:
                    if t.metadata.get("session") == sid:
                        return t
            await asyncio.sleep(0.05)
        return None

    t = served.run(trained())
    assert t is not None and t.reward == 0.5


async def _get(url: str) -> Any:
    async with aiohttp.ClientSession(headers=gateway_auth()) as http, http.get(url) as r:
        return await r.json()


def test_a_turn_cut_at_its_token_limit_marks_the_trajectory_truncated(served: Served) -> None:
    """A gateway trajectory carries ``metadata.truncated`` when its last turn finished by
    ``length`` (what ``algo.mask_truncated`` reads), and not otherwise."""
    finishes: dict[str, str] = {}
    for limit in (1, 48):
        sid = uuid.uuid4().hex[:12]
        client = openai.OpenAI(base_url=f"{served.url}/sessions/{sid}/v1", api_key=served.key)
        r = client.chat.completions.create(
            model="t", messages=[{"role": "user", "content": "Hello!"}], max_tokens=limit
        )
        finishes[sid] = r.choices[0].finish_reason
        served.run(_post(f"{served.url}/sessions/{sid}/reward", {"reward": 1.0}))
    assert "length" in finishes.values() and "stop" in finishes.values(), finishes

    async def trained() -> dict[str, Any]:
        for _ in range(400):
            got = {
                t.metadata["session"]: t.metadata
                for batch in served.batches
                for t in batch.trajectories
                if t.metadata.get("session") in finishes
            }
            if len(got) == len(finishes):
                return got
            await asyncio.sleep(0.05)
        raise AssertionError(f"the sessions' trajectories never reached a batch: {got}")

    for sid, meta in served.run(trained()).items():
        assert bool(meta.get("truncated")) == (finishes[sid] == "length"), (sid, meta)


async def _post(url: str, body: dict[str, Any]) -> int:
    async with aiohttp.ClientSession(headers=gateway_auth()) as http:
        async with http.post(url, json=body) as r:
            assert r.status == 200, await r.text()
            return r.status
