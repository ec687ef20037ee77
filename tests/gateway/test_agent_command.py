"""``task.agent_command``: an external command per episode, with the real ``openai`` client
configured only by ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, posting its reward to the
session; a command that exits non-zero without a reward rejects its sample. Agent
functions that hang or raise lose their sample only, their engine requests aborted."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from asyncrl.config import (
    AgentTaskConfig,
    AlgoConfig,
    ControllerConfig,
    GatewayConfig,
    RunConfig,
)
from asyncrl.controllers.controller import Controller
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.gateway import Gateway
from asyncrl.gateway.agent import AgentSample, agent_gateway
from asyncrl.secret import auth_headers

SCRIPT = """
import json, os, sys, urllib.request
import openai
sample = json.loads(os.environ["ASYNCRL_SAMPLE"])
if sample["prompt"] == "fail":
    sys.exit(3)
client = openai.OpenAI()  # OPENAI_BASE_URL, OPENAI_API_KEY from the environment
msgs = [{"role": "user", "content": sample["prompt"]}]
client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
req = urllib.request.Request(
    os.environ["ASYNCRL_REWARD_URL"], json.dumps({"reward": 0.75}).encode(),
    {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
     "Content-Type": "application/json"})
urllib.request.urlopen(req).read()
"""


async def _until(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.05)


def test_external_command_agent(chat_model_dir: Path, engine_url: str) -> None:
    cfg = RunConfig(
        controller=ControllerConfig(batch_size=1, max_staleness=200),
        algo=AlgoConfig(group_size=1),
        task=AgentTaskConfig(agent_command=[sys.executable, "-c", SCRIPT]),
        gateway=GatewayConfig(enabled=True, max_tokens=8, session_timeout_s=60),
    )

    async def scenario() -> None:
        engine = SGLangClient(engine_url)
        gw = agent_gateway(cfg, str(chat_model_dir))
        ctl = Controller(cfg, gw.episode, engines=[engine])
        gw.attach(ctl)
        await gw.start()
        try:
            async with ctl:
                ctl.submit([AgentSample(prompt="fail", id=0), AgentSample(prompt="Hi!", id=1)])
                batch = await asyncio.wait_for(ctl.next_batch(), 60)
                (traj,) = batch.trajectories
                assert traj.reward == 0.75 and batch.samples[0].id == 1
                assert sum(traj.loss_mask) == len(traj.response_ids) > 0
                assert gw.stats()["rewarded"] == 1
                # The failing command runs beside the good one and may exit after the
                # batch is out: wait for its rejection rather than race it.
                await asyncio.wait_for(_until(lambda: ctl.counters["rejected"] == 1), 60)
        finally:
            await gw.close()
            await engine.close()

    asyncio.run(scenario())


LONG = 4000  # a completion budget far beyond what runs before the agent is stopped


async def _engine_info(url: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession(headers=auth_headers()) as http,
        http.get(url + "/get_server_info") as r,
    ):
        return dict(await r.json())


async def _engine_idle(url: str, timeout_s: float = 30) -> int:
    """The engine's token count once it holds no request (TimeoutError after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (info := await _engine_info(url))["num_requests"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine still holds {info['num_requests']} requests")
        await asyncio.sleep(0.02)
    return int(info["tokens"])


def test_a_failing_agent_loses_its_sample_and_its_requests_are_aborted(
    chat_model_dir: Path, engine_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Agent functions that fail alone, each while a long completion of its session runs at
    the engine: one that hangs (past ``gateway.agent_timeout_s``) and one that raises. Each
    loses its sample only (rejected, logged once with the sample id: the error's traceback
    once, a hang as one line), its completion is aborted at the engine (far fewer than
    LONG tokens made), and the next sample trains. Before: the hang stalled its episode
    forever, silently, and the raise ended the controller."""
    cfg = RunConfig(
        controller=ControllerConfig(batch_size=1, max_staleness=200),
        algo=AlgoConfig(group_size=1),
        gateway=GatewayConfig(enabled=True, max_tokens=8, agent_timeout_s=1.0),
    )
    long_call = {"max_tokens": LONG, "extra_body": {"ignore_eos": True}}
    left: list[Any] = []

    async def agent(client: Any, sample: AgentSample) -> float:
        msgs: Any = [{"role": "user", "content": sample.prompt}]
        if sample.prompt == "hang":  # waits for its long completion, past the timeout
            await client.chat.completions.create(model="m", messages=msgs, **long_call)
        if sample.prompt == "raise":  # leaves its long completion running, and raises
            call = client.chat.completions.create(model="m", messages=msgs, **long_call)
            left.append(asyncio.ensure_future(call))  # never awaited by the agent
            while not (await _engine_info(engine_url))["num_requests"]:
                await asyncio.sleep(0.01)
            raise RuntimeError(f"boom on {sample.prompt}")
        await client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
        return 0.5

    async def scenario() -> None:
        engine = SGLangClient(engine_url)
        gw = Gateway(cfg.gateway, str(chat_model_dir), agent=agent, sample_type=AgentSample)
        ctl = Controller(cfg, gw.episode, engines=[engine])
        gw.attach(ctl)
        await gw.start()
        try:
            async with ctl:
                for k, prompt in enumerate(["hang", "raise"]):
                    before = await _engine_idle(engine_url)
                    ctl.submit([AgentSample(prompt=prompt, id=10 + k)])
                    rejected = k + 1
                    await asyncio.wait_for(
                        _until(lambda n=rejected: ctl.counters["rejected"] == n), 60
                    )
                    assert await _engine_idle(engine_url) - before < LONG // 2
                ctl.submit([AgentSample(prompt="Hi!", id=12)])
                batch = await asyncio.wait_for(ctl.next_batch(), 60)
                assert batch.samples[0].id == 12 and batch.trajectories[0].reward == 0.5
                assert gw.stats()["timed_out"] == 1 and gw.stats()["agent_failed"] == 1
        finally:
            await gw.close()
            await engine.close()

    with caplog.at_level(logging.WARNING, logger="asyncrl.gateway"):
        asyncio.run(scenario())
    lines = [r for r in caplog.records if r.name == "asyncrl.gateway"]
    assert [("sample id 10" in r.getMessage(), r.exc_info is None) for r in lines[:1]] == [
        (True, True)
    ]
    assert "agent_timeout_s=1s" in lines[0].getMessage()
    raised = [r for r in lines if "sample id 11" in r.getMessage()]
    assert len(raised) == 1 and raised[0].exc_info is not None
    assert "RuntimeError: boom on raise" in raised[0].getMessage()
    assert len(lines) == 2, [r.getMessage() for r in lines]
