"""``task.name = "agent"``: an OpenAI-API agent function per episode, through the gateway.

``async def fn(client, sample) -> float | None``: ``client`` is an ``openai.AsyncOpenAI``
whose ``base_url`` is the episode's session; ``sample`` an :class:`AgentSample`. The
float is the reward of every trajectory the session made; None rejects the sample.
Samples come from ``task.path`` (JSONL, one object per line: ``prompt`` (text) or
``messages`` (a chat), and ``answer``) or, without a path, the built-in weather task
(``prompt`` "What is the weather in CITY?", ``answer`` the city). The agents themselves are
the user's: examples (``weather_agent`` for the weather task, ``reverse_agent``,
``reverse_chat_agent``) are in ``examples/agents.py`` (``--task.agent=
examples/agents.py:weather_agent``).
"""

from __future__ import annotations

import inspect
import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.config import AgentTaskConfig, RunConfig
from asyncrl.gateway.app import AgentFn, Gateway
from asyncrl.tasks.base import load_reward_fn

__all__ = ["AgentSample", "agent_gateway", "agent_samples", "check_agent"]

CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito"]


class AgentSample(msgspec.Struct, frozen=True):
    """One task sample handed to the agent function."""

    prompt: str = ""
    messages: list[dict[str, Any]] = []
    answer: Any = None
    id: int = 0


def _agent_task(cfg: RunConfig) -> AgentTaskConfig:
    if not isinstance(cfg.task, AgentTaskConfig):
        raise ValueError(f"task.name={cfg.task.name!r} runs no agent (task.name='agent' does)")
    return cfg.task


def agent_samples(cfg: RunConfig) -> Iterator[AgentSample]:
    """The task's samples, forever (the file's rows in order, again and again)."""
    tc = _agent_task(cfg)
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
    tc = _agent_task(cfg)
    if bool(tc.agent) == bool(tc.agent_command):
        raise ValueError(
            "task.name='agent' needs task.agent='package.module:function' or "
            "task.agent_command=[argv...] (one of the two)"
        )
    budget = cfg.generation_budget()  # a completion naming no max_tokens (0 would be nothing)
    gw = Gateway(cfg.gateway, model_path, default_max_tokens=budget, sample_type=AgentSample)
    gw.agent = load_reward_fn(tc.agent) if tc.agent else command_agent(gw, tc.agent_command)
    return gw


def check_agent(t: AgentTaskConfig) -> None:
    """The agent task's preflight: one of ``task.agent`` / ``task.agent_command``; a
    ``task.path`` that is a file; an agent function that imports, is an ``async def`` and
    takes ``(client, sample)``. ValueError naming the key."""
    if bool(t.agent) == bool(t.agent_command):
        raise ValueError(
            "task.name='agent' needs task.agent='package.module:function' (an async def "
            "fn(client, sample)) or task.agent_command=[argv...], one of the two (the built-in "
            "weather task's example agent: --task.agent=examples/agents.py:weather_agent)"
        )
    if t.path and not Path(t.path).is_file():
        raise ValueError(f"task.path {t.path!r} is not a file (task.name='agent')")
    if not t.agent:
        return
    fn = load_reward_fn(t.agent, key="task.agent")
    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    form = f"async def {name}(client, sample) -> float | None"
    if not _is_async(fn):
        raise ValueError(
            f"task.agent {t.agent!r}: {name} is not an async function; an agent is awaited once "
            f"per episode: {form}"
        )
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as exc:
        raise ValueError(
            f"task.agent {t.agent!r}: {name} cannot be called with (client, sample): {exc}; "
            f"an agent is {form}"
        ) from None
    except ValueError:  # no signature to read (a builtin): it is called and tells itself
        pass


def _is_async(fn: Any) -> bool:
    """``fn(...)`` returns a coroutine, as far as can be told without calling it: an ``async
    def`` (or a ``functools.partial`` of one, or a wrapper whose ``__wrapped__`` is one), or an
    object whose ``__call__`` is."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(inspect.unwrap(fn)):
        return True
    call = inspect.getattr_static(type(fn), "__call__", None)
    routine = inspect.isroutine(fn) or inspect.isclass(fn)
    return not routine and call is not None and inspect.iscoroutinefunction(call)


def command_agent(gw: Gateway, argv: list[str]) -> AgentFn:
    """An agent function that runs ``argv`` per episode (see ``AgentTaskConfig.agent_command``):
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
