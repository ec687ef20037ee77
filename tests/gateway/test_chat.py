"""The gateway with the real ``openai`` client over a real embedded engine: exact ids,
multi-turn prefixes, loss masks, streaming, n > 1, tools, retries, errors."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import aiohttp
import openai
import pytest

from asyncrl.tasks.text import ChatTokenizer
from asyncrl.tasks.tiny_chat_model import WEATHER_TOOL

from .conftest import Served, gateway_auth


def _sid() -> str:
    return uuid.uuid4().hex[:12]


def _session(served: Served, sid: str) -> dict[str, Any]:
    return served.run(_get(f"{served.url}/sessions/{sid}"))


async def _get(url: str) -> Any:
    async with aiohttp.ClientSession(headers=gateway_auth()) as http, http.get(url) as r:
        return await r.json()


def _engine_calls(served: Served, n: int) -> list[tuple[list[int], list[int]]]:
    """The last ``n`` engine answers as (input ids, output ids)."""
    return [(ids, res.output_ids) for _, ids, res in served.engine.results[-n:]]


def _check_branch(b: dict[str, Any], calls: list[tuple[list[int], list[int]]]) -> None:
    """The branch is the engine's own ids: each call's input is the branch up to there,
    each call's output follows it with mask 1; every other token has mask 0."""
    ids, mask = b["token_ids"], b["loss_mask"]
    assert len(ids) == len(mask) == len(b["logprobs"]) == len(b["versions"])
    model_positions: list[int] = []
    for inp, out in calls:
        assert ids[: len(inp)] == inp  # each turn's prompt starts with every earlier id
        assert ids[len(inp) : len(inp) + len(out)] == out
        model_positions += range(len(inp), len(inp) + len(out))
    assert [i for i, m in enumerate(mask) if m] == model_positions


def test_sync_multi_turn_is_token_exact(served: Served, chat_model_dir: Any) -> None:
    sid = _sid()
    client = openai.OpenAI(base_url=f"{served.url}/sessions/{sid}/v1", api_key=served.key)
    msgs: list[Any] = [{"role": "user", "content": "Hello!"}]
    r1 = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20)
    first = _engine_calls(served, 1)
    tok = ChatTokenizer(chat_model_dir)
    assert first[0][0] == tok.encode(tok.render(msgs))  # turn 1: the template, whole
    assert r1.usage is not None and r1.usage.completion_tokens == len(first[0][1])
    msgs += [r1.choices[0].message.model_dump(exclude_none=True)]
    msgs += [{"role": "user", "content": "Good morning!"}]
    client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20)
    calls = _engine_calls(served, 2)
    (b,) = _session(served, sid)["branches"]
    assert b["turns"] == 2
    _check_branch(b, calls)
    assert calls[1][0][: len(calls[0][0]) + len(calls[0][1])] == calls[0][0] + calls[0][1]


def test_async_stream_n2_logprobs_usage(served: Served) -> None:
    sid = _sid()

    async def go() -> tuple[dict[int, str], Any, int]:
        client = openai.AsyncOpenAI(base_url=f"{served.url}/sessions/{sid}/v1", api_key=served.key)
        text: dict[int, str] = {0: "", 1: ""}
        lps = 0
        usage = None
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hey there!"}],
            n=2,
            max_tokens=24,
            logprobs=True,
            top_logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text[c.index] += c.delta.content or ""
                lps += len(c.logprobs.content or []) if c.logprobs else 0
        await client.close()
        return text, usage, lps

    text, usage, lps = asyncio.run(go())
    calls = _engine_calls(served, 2)
    snap = _session(served, sid)
    assert len(snap["branches"]) == 2  # each choice its own trajectory
    outs = sorted(len(o) for _, o in calls)
    assert usage is not None and usage.completion_tokens == sum(outs) == lps
    tok = served.gw.tok
    for b in snap["branches"]:
        out = b["token_ids"][b["prompt_len"] :]
        assert (inp := b["token_ids"][: b["prompt_len"]]) == calls[0][0]
        assert (inp, out) in calls
        assert tok.decode(out) in text.values()


def test_tool_call_round_trip(served: Served) -> None:
    sid = _sid()
    client = openai.OpenAI(base_url=f"{served.url}/sessions/{sid}/v1", api_key=served.key)
    msgs: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    tools: Any = [WEATHER_TOOL]
    r1 = client.chat.completions.create(model="t", messages=msgs, tools=tools, temperature=0)
    choice = r1.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    args = json.loads(call.function.arguments)  # type: ignore[union-attr]
    msgs += [choice.message.model_dump(exclude_none=True)]
    msgs += [
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({**args, "weather": "windy"}),
        }
    ]
    r2 = client.chat.completions.create(model="t", messages=msgs, tools=tools, temperature=0)
    assert r2.choices[0].finish_reason == "stop"
    assert "windy" in (r2.choices[0].message.content or "")
    (b,) = _session(served, sid)["branches"]
    assert b["turns"] == 2
    _check_branch(b, _engine_calls(served, 2))


def test_streamed_tool_call(served: Served) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/sessions/{_sid()}/v1", api_key=served.key)
    stream = client.chat.completions.create(
        model="t",
        messages=[{"role": "user", "content": "What is the weather in Lima?"}],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        temperature=0,
        stream=True,
    )
    calls, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and calls[0].function.name == "get_weather"  # type: ignore[union-attr]


def test_a_retried_request_makes_no_second_turn(served: Served) -> None:
    sid = _sid()
    body = {"model": "t", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8}

    async def twice() -> list[Any]:
        async with aiohttp.ClientSession(headers=gateway_auth()) as http:
            url = f"{served.url}/sessions/{sid}/v1/chat/completions"
            raw = json.dumps(body)
            hdr = {"Content-Type": "application/json"}
            calls = [http.post(url, data=raw, headers=hdr) for _ in range(2)]
            out = []
            for c in calls:
                async with c as r:
                    out.append(await r.json())
            return out

    n0 = len(served.engine.results)
    a, b = served.run(twice())
    assert a == b
    assert len(served.engine.results) == n0 + 1
    (br,) = _session(served, sid)["branches"]
    assert br["turns"] == 1


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"tool_choice": "required", "tools": [WEATHER_TOOL]}, "tool_choice"),
        ({"n": 1000}, "n"),
        ({"temperature": "hot"}, "temperature"),
        ({"extra_body": {"bogus_arg": 1}}, "bogus_arg"),
        ({"messages": []}, "messages"),
    ],
)
def test_bad_requests_get_openai_errors(served: Served, extra: dict[str, Any], param: str) -> None:
    client = openai.OpenAI(
        base_url=f"{served.url}/sessions/{_sid()}/v1", api_key=served.key, max_retries=0
    )
    body: dict[str, Any] = {"model": "t", "messages": [{"role": "user", "content": "Hi!"}]}
    body.update(extra)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**body)
    assert err.value.status_code == 400
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == param


def test_metadata_is_accepted_and_models_listed(served: Served) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/sessions/{_sid()}/v1", api_key=served.key)
    r = client.chat.completions.create(
        model="t",
        messages=[{"role": "user", "content": "Hi!"}],
        max_completion_tokens=4,
        user="u1",
        metadata={"k": "v"},
        store=False,
        parallel_tool_calls=True,
        seed=3,
        stop=["\n"],
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in client.models.list()] == [served.gw.model]


def test_reverse_chat_task_knows_the_format_not_the_order(served: Served) -> None:
    """The chat model's warm start for the learnable chat task (``reverse_chat_agent``):
    asked ``Reverse: 3 8 1``, it answers ``Answer:`` and (mostly) the request's own digits,
    in orders that differ between samples (the entropy RL learns from); the agent's reward is
    the fraction of positions right."""
    from asyncrl.gateway.agent import AgentSample
    from examples.agents import reverse_chat_agent

    client = openai.OpenAI(base_url=f"{served.url}/sessions/{_sid()}/v1", api_key=served.key)
    msgs: Any = [{"role": "user", "content": "Reverse: 3 8 1"}]
    r = client.chat.completions.create(model="t", messages=msgs, n=8, max_tokens=16)
    replies = [(c.message.content or "").split() for c in r.choices]
    assert all(w[0] == "Answer:" and len(w) == 4 for w in replies), replies
    perms = [tuple(w[1:]) for w in replies if sorted(w[1:]) == ["1", "3", "8"]]
    assert len(perms) >= 5 and len(set(perms)) > 1, replies  # its digits, not one fixed order

    async def agent() -> float:
        aclient = openai.AsyncOpenAI(
            base_url=f"{served.url}/sessions/{_sid()}/v1", api_key=served.key
        )
        try:
            return await reverse_chat_agent(aclient, AgentSample("Reverse: 3 8 1", answer="1 8 3"))
        finally:
            await aclient.close()

    assert asyncio.run(agent()) in (0.0, 1 / 3, 2 / 3, 1.0)
