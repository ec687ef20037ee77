"""DAPO dynamic sampling in the controller (``algo.filter_groups``): groups whose rewards are
all equal never reach a batch, their slots are released so admission refills the batch,
``Batch.filtered`` counts them per step, and ``algo.filter_max_groups`` caps them per step.
In-process engines on a virtual clock (tests/controllers/fakes.py)."""

from __future__ import annotations

import asyncio
import random

import pytest

from asyncrl.config import AlgoConfig, ControllerConfig, LocalRolloutConfig, RunConfig
from asyncrl.controllers.controller import Controller, NoMoreSamples
from asyncrl.controllers.episode import EpisodeContext
from tests.controllers.fakes import FakeEngine, VirtualTimeLoop


async def _drive(filter_groups: bool, cap: int, samples: int = 24) -> tuple[list, dict]:
    cfg = RunConfig(
        controller=ControllerConfig(batch_size=2, max_staleness=1, health_interval_s=0.5),
        algo=AlgoConfig(group_size=3, filter_groups=filter_groups, filter_max_groups=cap),
        rollout=LocalRolloutConfig(max_new_tokens=4),
    )
    rng = random.Random(0)
    engines = [FakeEngine("e0", rng, 0.05)]

    async def episode(ctx: EpisodeContext, sample: int):
        gen = await ctx.generate([1, 2, sample])
        # samples divisible by 3: every episode gets reward 1 (no signal); others vary
        reward = 1.0 if sample % 3 == 0 else float(ctx.episode_id % 2)
        traj = ctx.trajectory([1, 2, sample], [gen], reward)
        traj.metadata = {"sample": sample}
        return traj

    batches = []
    async with Controller(cfg, episode, engines, source=range(samples)) as ctl:
        ctl.end_input()
        while True:
            try:
                batch = await ctl.next_batch()
            except NoMoreSamples:
                break
            batches.append(batch)
            await asyncio.sleep(0.3)
            await ctl.set_version(batch.step + 1)
            for e in engines:
                e.version = batch.step + 1
        return batches, ctl.stats()


def _run(filter_groups: bool, cap: int = 0) -> tuple[list, dict]:
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(asyncio.wait_for(_drive(filter_groups, cap), 1e5))
    finally:
        loop.close()


def test_uniform_groups_are_filtered_and_the_batch_refilled() -> None:
    batches, st = _run(True)
    trained = [g[0].metadata["sample"] for b in batches for g in b.groups]
    assert trained and all(s % 3 for s in trained)  # no uniform group reached a batch
    assert all(len({t.reward for t in g}) > 1 for b in batches for g in b.groups)
    assert sorted(trained) == [s for s in range(24) if s % 3]  # every useful group trained once
    assert sum(b.filtered for b in batches) <= st["filtered"] == 8
    assert all(len(b.groups) == 2 for b in batches)  # full batches: refilled from new groups
    assert (
        st["groups_admitted"]
        == st["trained"]
        + st["filtered"]
        + st["rejected"]
        + st["failed"]
        + st["stale_dropped"]
        + st["stale_regenerated"]
    )


def test_off_keeps_uniform_groups() -> None:
    batches, st = _run(False)
    assert st["filtered"] == 0 and all(b.filtered == 0 for b in batches)
    assert sorted(g[0].metadata["sample"] for b in batches for g in b.groups) == list(range(24))


@pytest.mark.parametrize("cap", [1, 2])
def test_cap_bounds_filtered_groups_per_step(cap: int) -> None:
    batches, st = _run(True, cap)
    assert all(b.filtered <= cap for b in batches)
    uniform_trained = [g for b in batches for g in b.groups if g[0].metadata["sample"] % 3 == 0]
    assert st["filtered"] + len(uniform_trained) == 8  # past the cap they are trained
