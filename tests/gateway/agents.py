"""Agent functions the gateway tests run (``--task.agent=tests.gateway.agents:NAME`` in an
``asyncrl run`` subprocess, or handed to a Gateway in process)."""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.gateway.agent import AgentSample
from examples.agents import weather_agent

RAISES_ON = 1
"""The sample id :func:`flaky` raises on."""
SLEEPS_ON = 2
"""The sample id :func:`flaky` hangs on (after one chat call)."""


async def flaky(client: Any, sample: AgentSample) -> float:
    """The built-in weather agent, except on two samples: it raises ``ValueError('odd
    sample')`` on sample id 1 and, on sample id 2, makes one chat call and then sleeps for an
    hour (a hung agent)."""
    if sample.id == RAISES_ON:
        raise ValueError("odd sample")
    if sample.id == SLEEPS_ON:
        msgs: Any = [{"role": "user", "content": sample.prompt}]
        await client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
        await asyncio.sleep(3600)
    return await weather_agent(client, sample)


async def always_raises(client: Any, sample: AgentSample) -> float:
    """An agent with a bug: every sample raises the same error."""
    raise KeyError(f"no tool for sample {sample.id}")
