"""Gateway sessions in flight at a checkpoint, then a resume (a new controller and gateway
from the checkpointed controller state, encoded and decoded as the checkpoint file is;
what ``asyncrl run --resume`` does after a SIGKILL), with the real ``openai`` client and a
real engine:

- a client-opened session is dropped (counted ``restart_dropped``, its group rejected);
  the client going on with the same id at the new gateway opens a new session there,
  whose earlier turns are prompt (loss mask 0);
- an agent-mode session resumes: the agent function runs again, and its call made before
  the checkpoint is answered from the checkpoint's journal (not generated again)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import openai

from asyncrl.config import AlgoConfig, ControllerConfig, GatewayConfig, RunConfig
from asyncrl.controllers.controller import Controller
from asyncrl.controllers.state import ControllerState
from asyncrl.engines.rollout.local.inproc import InProcEngine
from asyncrl.gateway import Gateway
from asyncrl.gateway.agent import AgentSample

from .conftest import RecordingEngine

CFG = RunConfig(
    controller=ControllerConfig(batch_size=1, max_staleness=200),
    algo=AlgoConfig(group_size=1),
    gateway=GatewayConfig(enabled=True, max_tokens=8, admission_timeout_s=10),
)


async def _until(what: str, ok: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        await asyncio.sleep(0.02)


class Run:
    """A controller + gateway (one process's part of a run), optionally resumed."""

    def __init__(self, model: Path, engine: Any, agent: Any = None, state: Any = None):
        self.engine = RecordingEngine(engine)
        self.gw = Gateway(CFG.gateway, str(model), agent=agent, sample_type=AgentSample)
        kw = {"resume": state, "sample_type": Any}
        self.ctl = Controller(CFG, self.gw.episode, engines=[self.engine], **kw)
        self.gw.attach(self.ctl)

    async def __aenter__(self) -> Run:
        self.url = await self.gw.start()  # first, as asyncrl run: resumed agents call it
        await self.ctl.__aenter__()
        return self

    def checkpoint(self) -> ControllerState:
        raw = msgspec.msgpack.encode(self.ctl.snapshot())  # as the checkpoint file holds it
        return msgspec.msgpack.decode(raw, type=ControllerState)

    async def __aexit__(self, *exc: object) -> None:
        await self.gw.close()
        await self.ctl.close()


def test_client_session_is_dropped_and_goes_on_as_new(
    chat_model_dir: Path, engine: InProcEngine
) -> None:
    sid = uuid.uuid4().hex[:12]

    async def scenario() -> None:
        msgs: list[Any] = [{"role": "user", "content": "Hello!"}]
        async with Run(chat_model_dir, engine) as old:
            client = openai.AsyncOpenAI(
                base_url=f"{old.url}/sessions/{sid}/v1", api_key=old.gw.api_key
            )
            r1 = await client.chat.completions.create(model="m", messages=msgs, max_tokens=8)
            state = old.checkpoint()  # the session is open: its group is running
            await client.close()
        assert [g.gid for g in state.running] == [0]
        async with Run(chat_model_dir, engine, state=state) as new:
            await _until("the old group to be dropped", lambda: new.ctl.counters["rejected"] == 1)
            assert new.gw.stats()["restart_dropped"] == 1 and sid not in new.gw.sessions.by_id
            client = openai.AsyncOpenAI(
                base_url=f"{new.url}/sessions/{sid}/v1", api_key=new.gw.api_key
            )
            msgs += [r1.choices[0].message.model_dump(exclude_none=True)]
            msgs += [{"role": "user", "content": "Go on"}]
            await client.chat.completions.create(model="m", messages=msgs, max_tokens=8)
            await client.close()
            (b,) = new.gw.sessions.by_id[sid].snapshot()["branches"]
            (_, ids, res) = new.engine.results[-1]
            assert b["turns"] == 1 and b["token_ids"] == ids + res.output_ids
            assert sum(b["loss_mask"]) == len(res.output_ids)  # only the turn after the restart
            new.gw.sessions.by_id[sid].end(1.0)
            batch = await asyncio.wait_for(new.ctl.next_batch(), 30)
            (traj,) = batch.trajectories
            assert traj.metadata["session"] == sid
            assert traj.response_ids.tolist() == res.output_ids

    asyncio.run(scenario())


def test_agent_session_resumes_from_the_journal(chat_model_dir: Path, engine: InProcEngine) -> None:
    first_done = asyncio.Event()
    go_on = asyncio.Event()
    runs: list[list[Any]] = []

    async def agent(client: Any, sample: AgentSample) -> float:
        msgs: list[Any] = [{"role": "user", "content": sample.prompt}]
        seen: list[Any] = []
        runs.append(seen)
        for turn in range(2):
            r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=6)
            seen.append(r.choices[0].message.content)
            msgs += [r.choices[0].message.model_dump(exclude_none=True)]
            msgs += [{"role": "user", "content": f"And then {turn}?"}]
            if len(runs) == 1:
                first_done.set()
                await go_on.wait()  # the checkpoint is taken here; this run never goes on
        return 1.0

    async def scenario() -> None:
        async with Run(chat_model_dir, engine, agent=agent) as old:
            old.ctl.submit([AgentSample(prompt="Hello!", id=7)])
            await asyncio.wait_for(first_done.wait(), 30)
            state = old.checkpoint()
            made_before = [res.output_ids for _, _, res in old.engine.results]
        (group,) = state.running
        (episode,) = group.episodes
        assert [c.output_ids for c in episode.calls] == made_before  # one call, journaled
        async with Run(chat_model_dir, engine, agent=agent, state=state) as new:
            batch = await asyncio.wait_for(new.ctl.next_batch(), 30)
            assert new.ctl.resumed["episodes"] == 1
            assert len(new.engine.results) == 1  # the first call came from the journal
            (traj,) = batch.trajectories
            ids = traj.prompt_ids.tolist() + traj.response_ids.tolist()
            (_, second_input, second) = new.engine.results[0]
            assert ids[: len(second_input)] == second_input
            n = len(traj.prompt_ids)
            assert second_input[n : n + len(made_before[0])] == made_before[0]
            assert ids[len(second_input) :] == second.output_ids
        assert runs[1][0] == runs[0][0]  # the agent saw the same first answer again

    asyncio.run(scenario())
