"""``task.agent_command``: an external command per episode, with the real ``openai`` client
configured only by ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, posting its reward to the
session; a command that exits non-zero without a reward rejects its sample."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path

from asyncrl.config import (
    AlgoConfig,
    ControllerConfig,
    GatewayConfig,
    RunConfig,
    TaskConfig,
)
from asyncrl.controllers.controller import Controller
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.gateway.agent import AgentSample, agent_gateway

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
        task=TaskConfig(name="agent", agent_command=[sys.executable, "-c", SCRIPT]),
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
