"""A real agent framework (the OpenAI Agents SDK, from PyPI) runs a multi-turn, tool-using
episode through the gateway, offline, against the real engine."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp

from .conftest import Served, gateway_auth


def test_openai_agents_sdk_tool_episode(served: Served) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    sid = uuid.uuid4().hex[:12]
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f'{{"city": "{city}", "weather": "windy"}}'

    async def episode() -> Any:
        client = AsyncOpenAI(base_url=f"{served.url}/sessions/{sid}/v1", api_key=served.key)
        agent = Agent(
            name="weather",
            instructions="You are a helpful assistant.",
            tools=[get_weather],
            model=OpenAIChatCompletionsModel(model="tiny", openai_client=client),
            model_settings=ModelSettings(temperature=0.0, max_tokens=64),
        )
        result = await Runner.run(agent, "What is the weather in Oslo?", max_turns=4)
        await client.close()
        return result.final_output

    final = served.run(episode())
    assert asked, f"the agent never called its tool: {final!r}"
    assert "windy" in final

    async def snapshot() -> Any:
        async with aiohttp.ClientSession(headers=gateway_auth()) as http:
            async with http.get(f"{served.url}/sessions/{sid}") as r:
                return await r.json()

    snap = served.run(snapshot())
    assert snap["branches_opened"] == 0  # the framework's history continued one branch
    (b,) = snap["branches"]
    assert b["turns"] == 2
    n = b["prompt_len"]
    assert any(b["loss_mask"][n:]) and not all(b["loss_mask"][n:])  # the tool's tokens masked
    asyncio.get_event_loop_policy()  # (no loop left running in this thread)
