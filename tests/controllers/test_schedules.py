"""Property test: random schedules never train a sample beyond the bound, lose or duplicate one.

Each example builds a controller over 1-3 in-process engines on a virtual-time
loop, with random generation speeds, engine failures and outages, rejected
samples, multi-turn episodes, random train/update times and pause modes
(abort / in_place / wait, some updates failing), a group's identical requests
batched into one call or not (``controller.batch_requests``; a batch fails
whole), and trains until every sample is accounted for.
"""

from __future__ import annotations

import asyncio
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.config import AlgoConfig, ControllerConfig, LocalRolloutConfig, RunConfig
from asyncrl.controllers.controller import Controller, NoMoreSamples
from asyncrl.controllers.episode import EpisodeContext
from tests.controllers.fakes import FakeEngine, run_virtual

schedules = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**32 - 1),
        "samples": st.integers(1, 24),
        "batch_size": st.integers(1, 4),
        "group_size": st.integers(1, 3),
        "max_staleness": st.integers(0, 3),
        "engines": st.integers(1, 3),
        "policy": st.sampled_from(["drop", "regenerate"]),
        "fail_p": st.sampled_from([0.0, 0.0, 0.05, 0.3]),
        "outage_p": st.sampled_from([0.0, 0.2]),
        "reject_p": st.sampled_from([0.0, 0.2]),
        "train_s": st.floats(0.0, 3.0),
        "token_s": st.floats(0.01, 0.5),
        "update_fail_p": st.sampled_from([0.0, 0.3]),
        "retries": st.integers(0, 3),
        "batch": st.booleans(),
    }
)


async def _drive(p: dict) -> None:
    rng = random.Random(p["seed"])
    cfg = RunConfig(
        controller=ControllerConfig(
            batch_size=p["batch_size"],
            max_staleness=p["max_staleness"],
            stale_policy=p["policy"],
            max_retries=p["retries"],
            retry_backoff_s=0.1,
            health_interval_s=0.5,
            batch_requests=p["batch"],
        ),
        algo=AlgoConfig(group_size=p["group_size"]),
        rollout=LocalRolloutConfig(max_new_tokens=6),
    )
    engines = [FakeEngine(f"e{i}", rng, p["token_s"], p["fail_p"]) for i in range(p["engines"])]

    async def episode(ctx: EpisodeContext, sample: int):
        if rng.random() < p["reject_p"]:
            return None
        prompt = [1, 2, sample]
        turns: list = [await ctx.generate(prompt)]
        if rng.random() < 0.5:  # a tool call: environment tokens, then a second turn
            turns.append([7, 7])
            ids = prompt + turns[0].output_ids + [7, 7]
            turns.append(await ctx.generate(ids, max_new_tokens=3))
        traj = ctx.trajectory(prompt, turns, reward=float(sample % 2))
        traj.metadata = {"sample": sample}
        return traj

    trained: list[int] = []
    s = p["max_staleness"]
    async with Controller(cfg, episode, engines, source=range(p["samples"])) as ctl:
        ctl.end_input()
        version = 0
        while True:
            if rng.random() < p["outage_p"]:
                rng.choice(engines).down(rng.uniform(0.1, 5.0))
            try:
                batch = await ctl.next_batch()
            except NoMoreSamples:
                break
            for group in batch.groups:
                assert len({t.metadata["sample"] for t in group}) == 1
                for t in group:
                    assert batch.step - int(t.versions[t.loss_mask == 1].min()) <= s
                trained.append(group[0].metadata["sample"])
            await asyncio.sleep(p["train_s"] * rng.random())
            version = batch.step + 1
            while True:  # a failed update is retried; the engines must go on either way
                mode = rng.choice(["abort", "in_place", "wait"])
                try:
                    async with ctl.weight_update(version, mode):
                        await asyncio.sleep(rng.uniform(0.0, 1.0))
                        if rng.random() < p["update_fail_p"]:
                            raise OSError("injected update failure")
                        for e in engines:
                            e.version = version
                except OSError:
                    assert not any(e.paused for e in engines), "engine left paused"
                    continue
                break
            assert not any(e.paused for e in engines)
            assert ctl.staleness.version == version
        st_ = ctl.stats()
    assert len(trained) == len(set(trained)), f"duplicated: {trained}"
    accounted = len(trained) + st_["rejected"] + st_["failed"] + st_["stale_dropped"]
    assert accounted == p["samples"], (st_, trained)
    assert st_["trained"] == len(trained)
    assert st_["groups_admitted"] == (
        st_["trained"]
        + st_["rejected"]
        + st_["failed"]
        + st_["stale_dropped"]
        + st_["stale_regenerated"]
    )
    if p["fail_p"] == 0 and p["outage_p"] == 0:
        assert st_["failed"] == 0


@settings(
    max_examples=2000,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(schedules)
def test_random_schedules_respect_bound_and_lose_nothing(p: dict) -> None:
    run_virtual(asyncio.wait_for(_drive(p), timeout=1e5))
