"""``task.name = "agent"``: an OpenAI-API agent function per episode, through the gateway.

``async def fn(client, sample) -> float | None``: ``client`` is an ``openai.AsyncOpenAI``
whose ``base_url`` is the episode's session; ``sample`` an :class:`AgentSample`. The
float is the reward of every trajectory the session made; None rejects the sample.
Samples come from ``task.path`` (JSONL, one object per line: ``prompt`` (text) or
``messages`` (a chat), and ``answer``) or, without a path, the built-in weather task
(``prompt`` "What is the weather in CITY?", ``answer`` the city), whose example agent
is :func:`weather_agent`.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.config import RunConfig
from asyncrl.gateway.app import AgentFn, Gateway
from asyncrl.tasks.base import load_reward_fn

__all__ = [
    "AgentSample",
    "agent_gateway",
    "agent_samples",
    "reverse_agent",
    "reverse_chat_agent",
    "weather_agent",
]

CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito"]


class AgentSample(msgspec.Struct, frozen=True):
    """One task sample handed to the agent function."""

    prompt: str = ""
    messages: list[dict[str, Any]] = []
    answer: Any = None
    id: int = 0


def agent_samples(cfg: RunConfig) -> Iterator[AgentSample]:
    """The task's samples, forever (the file's rows in order, again and again)."""
    tc = cfg.task
    if not tc.path:
        rng = random.Random(tc.seed)
        for i in itertools.count():
            city = rng.choice(CITIES)
            yield AgentSample(prompt=f"What is the weather in {city}?", answer=city, id=i)
    rows = []
    for n, line in enumerate(Path(tc.path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"task.path {tc.path}: line {n} is not JSON ({exc})") from None
        if not isinstance(row, dict) or not (row.get("prompt") or row.get("messages")):
            raise ValueError(f"task.path {tc.path}: line {n} needs 'prompt' or 'messages'")
        rows.append(row)
    if not rows:
        raise ValueError(f"task.path {tc.path} holds no rows")
    for i, row in enumerate(itertools.cycle(rows)):
        yield AgentSample(
            str(row.get("prompt") or ""), list(row.get("messages") or []), row.get("answer"), i
        )


def agent_gateway(cfg: RunConfig, model_path: str) -> Gateway:
    """The run's gateway with the agent function ``task.agent`` or the external command
    ``task.agent_command`` (a ValueError names what is missing)."""
    tc = cfg.task
    if bool(tc.agent) == bool(tc.agent_command):
        raise ValueError(
            "task.name='agent' needs task.agent='package.module:function' or "
            "task.agent_command=[argv...] (one of the two)"
        )
    budget = cfg.generation_budget()  # a completion naming no max_tokens (0 would be nothing)
    gw = Gateway(cfg.gateway, model_path, default_max_tokens=budget, sample_type=AgentSample)
    gw.agent = load_reward_fn(tc.agent) if tc.agent else command_agent(gw, tc.agent_command)
    return gw


def command_agent(gw: Gateway, argv: list[str]) -> AgentFn:
    """An agent function that runs ``argv`` per episode (see ``TaskConfig.agent_command``):
    the reward is what the command posted to its session (none posted: the sample is
    rejected); a non-zero exit rejects the sample naming the exit status
    (:class:`EpisodeRejected`). The process is killed (by its pid) when the episode is
    cancelled or ``gateway.agent_timeout_s`` passes (the gateway cancels it)."""
    import asyncio
    import os

    from asyncrl.controllers.episode import EpisodeRejected

    async def run(client: Any, sample: Any) -> float | None:
        base = str(client.base_url).rstrip("/")
        s = gw.sessions.by_id[base.split("/")[-2]]
        env = {**os.environ, "OPENAI_BASE_URL": base, "OPENAI_API_KEY": s.key}
        env["ASYNCRL_SAMPLE"] = msgspec.json.encode(sample).decode()
        env["ASYNCRL_REWARD_URL"] = base[: -len("/v1")] + "/reward"
        proc = await asyncio.create_subprocess_exec(*argv, env=env)
        try:
            code = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        if code != 0:
            raise EpisodeRejected(f"the command exited with status {code}")
        return s.ended.result() if s.ended.done() else None

    run.argv = list(argv)  # type: ignore[attr-defined]  # how the gateway names it in logs
    return run


async def weather_agent(client: Any, sample: AgentSample) -> float:
    """The built-in task's agent: ask, run the ``get_weather`` tool it calls, answer.

    Reward (verifiable, from the transcript alone): 0.25 for a ``get_weather`` call naming
    the sample's city, 0.75 for a final answer that is exactly ``It is WEATHER in CITY.``
    (the weather the tool returned, the city asked about). v1 of the tiny chat model started
    near 0.3-0.45 (it calls the tool, but often misstates the weather or the city) and, being
    nearly deterministic after its warm start, did not learn it within 5 minutes at any
    learning rate tried (docs/results/gateway.md; not re-run on v2). The chat task that
    learns in minutes is :func:`reverse_chat_agent`."""
    from asyncrl.tasks.tiny_chat_model import WEATHER_TOOL

    msgs: list[Any] = [{"role": "user", "content": sample.prompt}]
    weather = random.Random(sample.id).choice(["sunny", "rainy", "cloudy", "windy"])
    reward = 0.0
    for _ in range(2):
        r = await client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER_TOOL])
        msg = r.choices[0].message
        msgs.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            answer = (msg.content or "").strip()
            return reward + (0.75 if answer == f"It is {weather} in {sample.answer}." else 0.0)
        for call in msg.tool_calls:
            try:
                city = json.loads(call.function.arguments).get("city")
            except (ValueError, AttributeError):
                city = None
            reward = 0.25 if city == sample.answer else reward
            out = json.dumps({"city": city, "weather": weather})
            msgs.append({"role": "tool", "tool_call_id": call.id, "content": out})
    return reward


async def reverse_agent(client: Any, sample: AgentSample) -> float:
    """The reverse task through ``/v1/completions`` (a base model: no chat template), for the
    tiny default model (``asyncrl.tasks.tiny_model``): ``sample.prompt`` is ``<s> D1 .. Dn =``,
    ``sample.answer`` the digits reversed (``"Dn .. D1"``); the reward is the fraction of
    positions right, as the built-in ``reverse`` task's. ``examples/reverse_agent.jsonl``
    holds every 2-digit sample."""
    answer = str(sample.answer).split()
    r = await client.completions.create(model="m", prompt=sample.prompt, max_tokens=len(answer) + 1)
    return _positions_right(r.choices[0].text.split(), answer)


async def reverse_chat_agent(client: Any, sample: AgentSample) -> float:
    """A chat task for the tiny chat model, through ``/v1/chat/completions``: the user asks
    ``Reverse: D1 D2 D3``, the reply should be ``Answer: D3 D2 D1``; the reward is the
    fraction of positions right (``sample.answer`` is ``"D3 D2 D1"``). The chat model's warm
    start answers every request with its own digits in a random order (it knows the format,
    not the rule): it starts near 0.3 with real entropy on the order.
    ``examples/reverse_chat.jsonl`` holds all 720 requests of three distinct digits."""
    answer = str(sample.answer).split()
    msgs: Any = [{"role": "user", "content": sample.prompt}]
    r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=16)
    text = (r.choices[0].message.content or "").strip()
    return _positions_right(text.removeprefix("Answer:").split(), answer)


def _positions_right(out: list[str], answer: list[str]) -> float:
    """The fraction of ``answer``'s positions that ``out`` has right."""
    return sum(a == b for a, b in zip(out, answer, strict=False)) / len(answer)
