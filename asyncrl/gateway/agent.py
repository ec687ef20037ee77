"""``task.name = "agent"``: an OpenAI-API agent function per episode, through the gateway.

``async def fn(client, sample) -> float | None``: ``client`` is an ``openai.AsyncOpenAI``
whose ``base_url`` is the episode's session; ``sample`` an :class:`AgentSample`. The
float is the reward of every trajectory the session made; None rejects the sample.
Samples come from ``task.path`` or ``task.sources`` (JSONL, Parquet or a ``datasets``
folder, read and mixed by :mod:`asyncrl.tasks.data`; rows: ``prompt`` (text) or ``messages``
(a chat), and ``answer``) or, without data, the built-in weather task
(``prompt`` "What is the weather in CITY?", ``answer`` the city). The agents themselves are
the user's: examples (``weather_agent`` for the weather task, ``reverse_agent``,
``reverse_chat_agent``) are in ``examples/agents.py`` (``--task.agent=
examples/agents.py:weather_agent``).
"""

from __future__ import annotations

import inspect
import itertools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.config import AgentTaskConfig, RunConfig
from asyncrl.config.task import DataSource
from asyncrl.gateway.app import AgentFn, Gateway
from asyncrl.tasks.base import load_reward_fn
from asyncrl.tasks.data import chat_messages, load_rows, mix, row_error

__all__ = ["AgentSample", "agent_gateway", "agent_samples", "check_agent"]

CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito"]


class AgentSample(msgspec.Struct, frozen=True):
    """One task sample handed to the agent function."""

    prompt: str = ""
    messages: list[dict[str, Any]] = []
    answer: Any = None
    id: int = 0
    source: str = ""
    """The name of the source the row came from (``task.sources``; empty: built-in)."""
    fields: dict[str, Any] = {}
    """The row's ``task.extra_keys`` columns (column -> value)."""


def _agent_task(cfg: RunConfig) -> AgentTaskConfig:
    if not isinstance(cfg.task, AgentTaskConfig):
        raise ValueError(f"task.name={cfg.task.name!r} runs no agent (task.name='agent' does)")
    return cfg.task


def agent_samples(cfg: RunConfig) -> Iterator[AgentSample]:
    """The task's samples, forever: rows of ``task.path`` / ``task.sources`` (read and mixed
    by :mod:`asyncrl.tasks.data`, as the ``math`` task's; one source unshuffled: its rows in
    order, again and again), else the built-in weather task's. Unusable rows fail here, at
    build time, naming the file, row and column."""
    tc = _agent_task(cfg)
    sources = tc.all_sources()
    if not sources:
        return _weather(tc.seed)
    labels = [s.label for s in sources]
    if len(set(labels)) < len(labels):
        raise ValueError(f"task.sources: two sources share a name ({labels}): set name")
    key = "task.sources" if tc.sources else "task.path"
    items = [_rows(tc, src, key) for src in sources]
    return _mixed(tc, items, labels, [s.weight for s in sources])


def _weather(seed: int) -> Iterator[AgentSample]:
    rng = random.Random(seed)
    for i in itertools.count():
        city = rng.choice(CITIES)
        yield AgentSample(prompt=f"What is the weather in {city}?", answer=city, id=i)


def _mixed(
    tc: AgentTaskConfig, items: list[list[AgentSample]], labels: list[str], weights: list[float]
) -> Iterator[AgentSample]:
    stream = mix([len(x) for x in items], weights, tc.seed, tc.shuffle)
    for i, (j, k) in enumerate(stream):
        yield msgspec.structs.replace(items[j][k], id=i, source=labels[j])


def _rows(tc: AgentTaskConfig, src: DataSource, key: str) -> list[AgentSample]:
    """One source's rows as samples (ids and source set when drawn)."""
    prompt_key = src.prompt_key or tc.prompt_key
    messages_key = src.messages_key or tc.messages_key
    answer_key = src.answer_key or tc.answer_key
    out = []
    for i, row in enumerate(load_rows(src.path, key)):
        prompt, chat = row.get(prompt_key), row.get(messages_key)
        messages = chat_messages(src.path, i, messages_key, chat) if chat else []
        if not prompt and not messages:
            raise row_error(
                src.path, i, prompt_key,
                f"missing or empty (nor a {messages_key!r} chat): task.prompt_key / "
                f"task.messages_key; the row has {sorted(row)}",
            )  # fmt: skip
        missing = [k for k in tc.extra_keys if k not in row]
        if missing:
            raise row_error(src.path, i, missing[0], "missing (task.extra_keys)")
        fields = {k: row[k] for k in tc.extra_keys}
        out.append(AgentSample(str(prompt or ""), messages, row.get(answer_key), fields=fields))
    if not out:
        raise ValueError(f"{key} {src.path} holds no rows")
    return out


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
    ``task.path`` / ``task.sources`` that exist; an agent function that imports, is an
    ``async def`` and takes ``(client, sample)``. ValueError naming the key."""
    if bool(t.agent) == bool(t.agent_command):
        raise ValueError(
            "task.name='agent' needs task.agent='package.module:function' (an async def "
            "fn(client, sample)) or task.agent_command=[argv...], one of the two (the built-in "
            "weather task's example agent: --task.agent=examples/agents.py:weather_agent)"
        )
    key = "task.sources" if t.sources else "task.path"
    for src in t.all_sources():
        if not Path(src.path).exists():
            raise ValueError(
                f"{key} {src.path!r} is not a file (task.name='agent'): give a .jsonl or "
                ".parquet file or a folder written by datasets' save_to_disk"
            )
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
