"""Example agents for ``asyncrl run --task.name=agent`` (docs/agents.md): each is an
``async def agent(client, sample) -> float | None``, ``client`` an ``openai.AsyncOpenAI`` on
the episode's gateway session, ``sample`` an ``AgentSample`` (``prompt``, ``messages``,
``answer``, ``id``); the float is the reward of every trajectory the session made.

    asyncrl run --task.name=agent --task.agent=examples/agents.py:weather_agent
    asyncrl run --task.name=agent --task.agent=examples/agents.py:reverse_chat_agent \\
        --task.path=examples/reverse_chat.jsonl

They are examples, not part of asyncrl: a run names its agent by ``package.module:function``
or ``path/to/file.py:function``, as these are named above (from the repository's root).
"""

from __future__ import annotations

import json
import random
from typing import Any

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
"""The tool the agent offers: the one the tiny chat model was trained to call
(``asyncrl.tasks.tiny_chat_model.WEATHER_TOOL``; tests/tasks check they are the same)."""


async def weather_agent(client: Any, sample: Any) -> float:
    """The built-in weather task's agent: ask, run the ``get_weather`` tool it calls, answer.

    Reward (verifiable, from the transcript alone): 0.25 for a ``get_weather`` call naming
    the sample's city, 0.75 for a final answer that is exactly ``It is WEATHER in CITY.``
    (the weather the tool returned, the city asked about). v1 of the tiny chat model started
    near 0.3-0.45 (it calls the tool, but often misstates the weather or the city) and, being
    nearly deterministic after its warm start, did not learn it within 5 minutes at any
    learning rate tried (docs/results/gateway.md; not re-run on v2). The chat task that
    learns in minutes is :func:`reverse_chat_agent`."""
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


async def reverse_agent(client: Any, sample: Any) -> float:
    """The reverse task through ``/v1/completions`` (a base model: no chat template), for the
    tiny default model: ``sample.prompt`` is ``<s> D1 .. Dn =``, ``sample.answer`` the digits
    reversed (``"Dn .. D1"``); the reward is the fraction of positions right, as the built-in
    ``reverse`` task's. ``examples/reverse_agent.jsonl`` holds every 2-digit sample."""
    answer = str(sample.answer).split()
    r = await client.completions.create(model="m", prompt=sample.prompt, max_tokens=len(answer) + 1)
    return _positions_right(r.choices[0].text.split(), answer)


async def reverse_chat_agent(client: Any, sample: Any) -> float:
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
