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
from tests.controllers.fakes import FakeEngine, run_virtual


async def _drive(
    filter_groups: bool, cap: int, samples: int = 24, uniform_mod: int = 3
) -> tuple[list, dict]:
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
        # (uniform_mod=-3: the other way round, two samples in three uniform)
        uniform = sample % abs(uniform_mod) == 0
        reward = 1.0 if uniform == (uniform_mod > 0) else float(ctx.episode_id % 2)
        traj = ctx.trajectory([1, 2, sample], [gen], reward)
        traj.metadata = {"sample": sample}
        return traj

    batches = []
    loop = asyncio.get_running_loop()
    async with Controller(cfg, episode, engines, source=range(samples)) as ctl:
        ctl.end_input()
        while True:
            t0 = loop.time()
            try:
                batch = await ctl.next_batch()
            except NoMoreSamples:
                break
            st = ctl.stats()  # capacity = (s + v + 1) B + the slots admitted ahead
            ahead = st["capacity"] - (1 + st["version"] + 1) * 2
            batches.append(batch)
            WAITS.append((loop.time() - t0, ahead))
            await asyncio.sleep(0.3)
            await ctl.set_version(batch.step + 1)
            for e in engines:
                e.version = batch.step + 1
        return batches, ctl.stats()


WAITS: list[tuple[float, int]] = []  # per batch of the last run: time next_batch took, ahead


def _run(filter_groups: bool, cap: int = 0, **kw: int) -> tuple[list, dict]:
    WAITS.clear()
    return run_virtual(asyncio.wait_for(_drive(filter_groups, cap, **kw), 1e5))


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


def test_refill_is_admitted_ahead_by_the_filtered_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two samples in three uniform: after a step that dropped some, admission runs ahead by
    the dropped share (bounded by the cap), so the trainer waits less for its batches than
    when every refill starts only after a drop (the look-ahead switched off)."""
    batches, st = _run(True, samples=60, uniform_mod=-3)
    aheads = [a for _, a in WAITS]
    assert min(aheads) >= 0 and max(aheads) > 0 and st["filtered"] == 40
    assert all(len(b.groups) == 2 for b in batches[:-1])
    waited = sum(w for w, _ in WAITS)
    _run(True, cap=1, samples=60, uniform_mod=-3)
    assert all(a <= 1 for _, a in WAITS)
    monkeypatch.setattr(Controller, "_admit_ahead", lambda self, filtered, trained: None)
    _, st_late = _run(True, samples=60, uniform_mod=-3)
    assert all(a == 0 for _, a in WAITS) and st_late["filtered"] == 40
    assert waited < 0.8 * sum(w for w, _ in WAITS)
    _run(False, samples=60, uniform_mod=-3)
    assert all(a == 0 for _, a in WAITS)
