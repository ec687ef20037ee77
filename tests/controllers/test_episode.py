"""The episode API against a real embedded engine (in this process, tests/inproc.py):
multi-turn with masked tool tokens, abort + resume with an exact budget and per-token versions,
engines that go on after a failed update; plus reward dispatch, resume counters and fail-over
on test doubles."""

from __future__ import annotations

import asyncio
import random
import re
import threading
from typing import Any

import pytest

from asyncrl.config import AlgoConfig, ControllerConfig, LocalRolloutConfig, RunConfig
from asyncrl.controllers.controller import Controller, GroupsFailing, NoMoreSamples
from asyncrl.controllers.episode import (
    EpisodeContext,
    EpisodeFailed,
    EpisodeRejected,
    Gate,
    Generation,
    RewardRunner,
)
from asyncrl.controllers.router import Router
from asyncrl.engines.rollout.local.inproc import InProcEngine
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.procs import free_port
from tests.controllers.fakes import FakeEngine, run_virtual


async def test_tool_tokens_masked_and_versions_exact(engine: InProcEngine) -> None:
    ctx = EpisodeContext(Router([engine]), 0, 123, {"max_new_tokens": 5}, 1, Gate())
    await engine.update_weight_version("4")
    t1 = await ctx.generate([1, 5, 6, 7, 14], ignore_eos=True)
    tool = [9, 9, 9]
    t2 = await ctx.generate([1, 5, 6, 7, 14, *t1.output_ids, *tool], max_new_tokens=2)
    traj = ctx.trajectory([1, 5, 6, 7, 14], [t1, tool, t2], reward=0.5)
    assert len(t1.output_ids) == 5 and len(t2.output_ids) <= 2
    assert traj.loss_mask.tolist() == [1] * 5 + [0] * 3 + [1] * len(t2.output_ids)
    assert traj.behav_logprobs[5:8].tolist() == [0.0, 0.0, 0.0]
    assert set(traj.versions.tolist()) == {4} and traj.min_version == 4
    assert ctx.min_version(traj) == 4
    with pytest.raises(TypeError, match=r"episode 123: ctx.trajectory\(\) got unknown field"):
        ctx.trajectory([1], [t1], reward=0.5, rewardz={"x": 1.0})  # a typo: refused at the call


def _tokens_generated(engine: InProcEngine) -> int:
    return int(engine.engine.stats["tokens"])


async def _tokens_when_idle(engine: InProcEngine, timeout_s: float = 120.0) -> int:
    """The engine's token count once it runs no request (an earlier test's controller may
    have left requests it cancelled running to their budget)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while engine.engine.num_requests:
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"the engine still runs {engine.engine.num_requests} requests")
        await asyncio.sleep(0.01)
    return _tokens_generated(engine)


async def test_generated_tokens_count_every_token_the_engine_returned(
    engine: InProcEngine,
) -> None:
    """``stats()["generated_tokens"]`` (the "generated" panel of ``asyncrl plot``): every token
    the engine returned, rejected episodes' too, equal to the engine's own count."""
    from asyncrl.core import Sample

    cfg = RunConfig(
        controller=ControllerConfig(batch_size=2, max_staleness=10),
        algo=AlgoConfig(group_size=2),
        rollout=LocalRolloutConfig(max_new_tokens=6),
    )

    async def episode(ctx: EpisodeContext, sample: Sample):  # type: ignore[no-untyped-def]
        gen = await ctx.generate(sample.prompt_ids)
        return ctx.trajectory(sample.prompt_ids, [gen], 0.0) if sample.id % 3 else None

    start = await _tokens_when_idle(engine)
    trained = 0
    async with Controller(cfg, episode, [engine]) as ctl:
        ctl.submit(Sample(prompt_ids=[1, 5, 6, 7], id=i) for i in range(6))
        ctl.end_input()
        with pytest.raises(NoMoreSamples):
            while True:
                trained += sum(len(t.response_ids) for t in (await ctl.next_batch()).trajectories)
        stats = ctl.stats()
    made = await _tokens_when_idle(engine) - start
    assert stats["rejected"] == 2 and stats["generated_tokens"] == made > trained > 0


async def test_abort_resumes_on_same_engine_with_exact_budget(engine: InProcEngine) -> None:
    budget = 600  # long enough that the abort lands mid-request on any machine (it lands at ~5-20)
    ctx = EpisodeContext(Router([engine]), 0, 7, {"max_new_tokens": budget}, 0, Gate())
    await engine.update_weight_version("0")
    start = _tokens_generated(engine)
    task = asyncio.ensure_future(ctx.generate([1, 5, 6, 7, 14], ignore_eos=True))
    while _tokens_generated(engine) < start + 5:  # the request is decoding
        await asyncio.sleep(0.005)
    await engine.pause_generation("abort")
    await engine.update_weight_version("1")
    await engine.continue_generation()
    gen = await asyncio.wait_for(task, 300)
    assert len(gen.output_ids) == budget == len(gen.logprobs) == len(gen.versions)
    assert gen.calls >= 2, "the abort should have interrupted the request"
    assert gen.versions == sorted(gen.versions) and set(gen.versions) <= {0, 1}
    assert gen.versions[0] == 0 and gen.versions[-1] == 1 and gen.finish_reason == "length"


async def test_engines_continue_after_failed_update(engine: InProcEngine) -> None:
    cfg = RunConfig(
        controller=ControllerConfig(batch_size=1, max_staleness=0),
        algo=AlgoConfig(group_size=1),
        rollout=LocalRolloutConfig(max_new_tokens=3),
    )

    async def episode(ctx: EpisodeContext, sample: list[int]):
        gen = await ctx.generate(sample)
        return ctx.trajectory(sample, [gen], 1.0)

    async with Controller(cfg, episode, [engine]) as ctl:
        for mode in ("abort", "in_place", "wait"):
            with pytest.raises(OSError):
                async with ctl.weight_update(1, mode):
                    raise OSError("update failed")
            assert ctl.staleness.version == 0
        ctl.submit([[1, 5, 6, 14]])
        ctl.end_input()
        batch = await asyncio.wait_for(ctl.next_batch(), 60)  # the engine still generates
        assert batch.step == 0 and len(batch.trajectories) == 1
        with pytest.raises(NoMoreSamples):
            await ctl.next_batch()


async def test_reward_runner_inlines_cheap_sync_and_threads_slow() -> None:
    loop_thread = threading.get_ident()
    seen: list[bool] = []

    def cheap(sample: object, ids: list[int]) -> float:
        seen.append(threading.get_ident() == loop_thread)
        return 1.0

    runner = RewardRunner(cheap, inline_s=0.01)
    vals = await asyncio.gather(*(runner(None, [1]) for _ in range(5)))
    vals.append(await runner(None, [1]))
    assert vals == [1.0] * 6 and seen[0] is False and seen[-1] is True

    def slow(sample: object, ids: list[int]) -> float:
        seen.append(threading.get_ident() == loop_thread)
        import time

        time.sleep(0.003)
        return 2.0

    seen.clear()
    runner = RewardRunner(slow, inline_s=0.001)
    for _ in range(3):
        assert await runner(None, []) == 2.0
    assert seen == [False, False, False]

    async def coro(sample: object, ids: list[int]) -> float:
        return 3.0

    assert await RewardRunner(coro)(None, []) == 3.0


async def test_one_reward_signature_and_the_old_form_refused_with_the_new_one() -> None:
    """``ctx.reward`` calls ``fn(sample, response_ids)``; a keyword-only ``text`` gets the
    text passed; the old three-argument form is refused, showing the signature to write."""
    ctx = EpisodeContext(Router([FakeEngine("e", random.Random(0), 0.01)]), 0, 1, {}, 0, Gate())

    def ids_only(sample: object, response_ids: list[int]) -> float:
        return float(len(response_ids))

    async def with_text(sample: object, response_ids: list[int], *, text: str) -> float:
        return float(text == "4 2")

    def old(sample: object, response_ids: list[int], response_text: str) -> float:
        return 1.0

    assert await ctx.reward(ids_only, None, [1, 2]) == 2.0
    assert await ctx.reward(with_text, None, [7, 5], text="4 2") == 1.0
    with pytest.raises(TypeError, match=r"takes `text`: pass the decoded response"):
        await ctx.reward(with_text, None, [7, 5])
    with pytest.raises(TypeError, match=r"\.old takes \(sample, response_ids, response_text\)"):
        await ctx.reward(old, None, [1])
    with pytest.raises(TypeError, match=r"write it as def fn\(sample, response_ids\) -> float"):
        await ctx.reward(lambda: 1.0, None, [1])


def test_episode_trajectory_arrays_are_writable_and_torch_wraps_them_silently() -> None:
    """Issue 37 item 10: every array ``ctx.trajectory`` builds is the trajectory's own and
    writable, so a trainer wraps it with ``torch.from_numpy`` (no copy) without torch's
    "not writable" warning (the single-turn loss mask was a read-only shared buffer)."""
    import warnings

    torch = pytest.importorskip("torch")
    from asyncrl.controllers.episode import Generation

    ctx = EpisodeContext(Router([FakeEngine("e", random.Random(0), 0.01)]), 0, 1, {}, 0, Gate())
    one = ctx.trajectory([1, 2], [Generation([5, 6], [-0.1, -0.2], [3, 3], "stop")], 1.0)
    turns = [Generation([5], [-0.1], [3], "length"), [9], Generation([7], [-1.0], [4], "stop")]
    two = ctx.trajectory([1], turns, 0.0)
    for traj in (one, two):
        for name in ("prompt_ids", "response_ids", "behav_logprobs", "versions", "loss_mask"):
            arr = getattr(traj, name)
            assert arr.flags.writeable, name
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert torch.from_numpy(arr).data_ptr() == arr.ctypes.data  # no copy
    one.loss_mask[0] = 0  # its own: another trajectory's mask is untouched
    again = ctx.trajectory([1, 2], [Generation([5, 6], [-0.1, -0.2], [3, 3], "stop")], 1.0)
    assert again.loss_mask.tolist() == [1, 1]


async def test_reward_errors_are_logged_once_per_distinct_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 37 item 5: 100 episodes in flight hitting the same raising reward log one
    traceback (each still raises RewardError naming the function, line and sample); a
    reward returning None is a RewardError naming the function and what it returned."""
    import logging

    from asyncrl.controllers.episode import RewardError
    from asyncrl.core import Sample

    def broken(sample: object, response_ids: list[int]) -> float:
        raise ValueError(f"boom {len(response_ids)}")

    def forgot_return(sample: object, response_ids: list[int]) -> float:
        float(len(response_ids))  # no return: None

    runner = RewardRunner(broken)
    with caplog.at_level(logging.ERROR, logger="asyncrl"):
        got = await asyncio.gather(
            *(runner(Sample(prompt_ids=[1], id=i), [1, 2]) for i in range(100)),
            return_exceptions=True,
        )
        assert all(isinstance(e, RewardError) and e.logged for e in got), got[:3]
        text = str(got[7])
        assert "broken raised ValueError: boom 2 at " in text and "(sample id 7)" in text
        assert sum(r.exc_info is not None for r in caplog.records) == 1, caplog.records
        none = RewardRunner(forgot_return)
        for i in range(3):
            with pytest.raises(RewardError, match=r"forgot_return returned None for sample id"):
                await none(Sample(prompt_ids=[1], id=i), [1])
    assert sum("forgot_return returned None" in r.getMessage() for r in caplog.records) == 1
    assert await RewardRunner(lambda s, ids: True)(None, [1]) == 1.0  # a bool is a number


def test_admission_counters_survive_resume_and_sync_mode_is_lockstep() -> None:
    import random

    async def go() -> None:
        rng = random.Random(0)
        engine = FakeEngine("e", rng, 0.1)
        cfg = RunConfig(
            controller=ControllerConfig(batch_size=2, max_staleness=0),
            algo=AlgoConfig(group_size=2),
            rollout=LocalRolloutConfig(max_new_tokens=4),
        )

        async def episode(ctx: EpisodeContext, sample: int):
            return ctx.trajectory([1], [await ctx.generate([1, sample])], 0.0)

        engine.version = 5
        async with Controller(cfg, episode, [engine], range(100), start_version=5) as ctl:
            await asyncio.sleep(0.01)
            st = ctl.stats()
            assert st["admitted_total"] == 12 and st["capacity"] == 12  # (0 + 5 + 1) * 2
            assert st["running"] == 2  # one batch in flight: synchronous
            for step in (5, 6, 7):
                b = await ctl.next_batch()
                assert b.step == step and b.staleness_max == 0
                assert ctl.stats()["running"] == 0  # nothing generates while "training"
                engine.version = step + 1
                await ctl.set_version(step + 1)

    run_virtual(go())


def test_failover_to_healthy_engine_and_back_into_rotation() -> None:
    import random

    async def go() -> None:
        rng = random.Random(1)
        a, b = FakeEngine("a", rng, 0.01), FakeEngine("b", rng, 0.01)
        cfg = RunConfig(
            controller=ControllerConfig(batch_size=4, max_staleness=1, health_interval_s=1.0),
            algo=AlgoConfig(group_size=1),
            rollout=LocalRolloutConfig(max_new_tokens=3),
        )

        async def episode(ctx: EpisodeContext, sample: int):
            return ctx.trajectory([1], [await ctx.generate([1, sample])], 0.0)

        async with Controller(cfg, episode, [a, b], range(40)) as ctl:
            ctl.end_input()
            a.down(5.0)
            n = 0
            while True:
                try:
                    batch = await ctl.next_batch()
                except NoMoreSamples:
                    break
                n += len(batch.groups)
                a.version = b.version = batch.step + 1
                await ctl.set_version(batch.step + 1)
            st = ctl.stats()
        assert n == 40 and st["failed"] == 0 and st["engine_failures"] >= 1
        assert st["engines_out"] == 0 or asyncio.get_running_loop().time() < 6.0
        assert b.requests > a.requests

    run_virtual(go())


async def test_an_outage_waits_for_an_engine_and_is_no_failure(engine: InProcEngine) -> None:
    """No engine in rotation (the only live one held: restarting or re-syncing; the other
    dead): the request waits, uncounted (max_retries=0), and runs once one is admitted."""
    live = engine
    dead = SGLangClient(f"http://127.0.0.1:{free_port()}", timeout_s=5)
    router = Router([dead, live])
    router.hold(live)
    waiting = asyncio.Event()  # the request waits for an engine in rotation (after failing)
    in_rotation = router.in_rotation

    async def spied() -> None:
        if router.unhealthy:
            waiting.set()
        await in_rotation()

    router.in_rotation = spied  # type: ignore[method-assign]
    ctx = EpisodeContext(router, 0, 9, {"max_new_tokens": 4}, 0, Gate())
    try:
        task = asyncio.ensure_future(ctx.generate([1, 5, 6, 7, 14], ignore_eos=True))
        await asyncio.wait_for(waiting.wait(), 60)  # failed on the dead engine, now waits
        assert id(dead) in router.unhealthy
        assert not task.done() and router.served[id(live)] == 0  # waiting, not failed
        router.admit(live)
        out = await asyncio.wait_for(task, 60)
        assert len(out.output_ids) == 4 and router.served[id(live)] == 1
    finally:
        await dead.close()


async def test_an_outage_longer_than_its_timeout_fails_the_episode(engine: InProcEngine) -> None:
    router = Router([engine], outage_timeout_s=0.5)
    router.hold(engine)
    ctx = EpisodeContext(router, 0, 10, {"max_new_tokens": 4}, 3, Gate())
    with pytest.raises(EpisodeFailed, match=r"no rollout engine in rotation for 0s \(1 engine"):
        await asyncio.wait_for(ctx.generate([1, 5, 6, 7, 14]), 60)
    assert router.served[id(engine)] == 0


async def test_every_episode_rejecting_is_warned_not_silent(
    engine: InProcEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """Episodes that all return None (with ``max_failed_groups = 0``, never stopping for it):
    next_batch gets nothing, and the log says why."""
    cfg = RunConfig(
        controller=ControllerConfig(batch_size=2, max_staleness=0, max_failed_groups=0),
        algo=AlgoConfig(group_size=2),
        rollout=LocalRolloutConfig(max_new_tokens=3),
    )

    async def episode(ctx: EpisodeContext, sample: int) -> None:
        return None

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if "groups in a row rejected" in r.message]

    async with Controller(cfg, episode, [engine], source=iter(range(10**9))) as ctl:
        batch = asyncio.ensure_future(ctl.next_batch())
        deadline = asyncio.get_running_loop().time() + 60
        while not warned():  # no quiet window: the warning comes, the batch does not
            assert asyncio.get_running_loop().time() < deadline, "no warning in 60 s"
            await asyncio.sleep(0.01)
        assert not batch.done() and ctl.counters["rejected"] >= 2
        batch.cancel()
    assert "every episode returned None" in warned()[0]


def _rejecting_controller(bound: int, every: int, staleness: int = 0) -> tuple[RunConfig, Any]:
    """A config with ``max_failed_groups = bound`` and an episode that trains every
    ``every``-th sample (0: none) and rejects the others: odd ones by raising
    :class:`EpisodeRejected` naming the sample, even ones by returning None."""
    cfg = RunConfig(
        controller=ControllerConfig(batch_size=2, max_staleness=staleness, max_failed_groups=bound),
        algo=AlgoConfig(group_size=2),
        rollout=LocalRolloutConfig(max_new_tokens=3),
    )

    async def episode(ctx: EpisodeContext, sample: int) -> Any:
        await asyncio.sleep(0)
        if every and sample % every == 0:
            return ctx.trajectory([1], [Generation([5], [-0.5], [0], "stop")], 1.0)
        if sample % 2:
            raise EpisodeRejected(f"the agent gave up on sample {sample}")
        return None

    return cfg, episode


async def test_a_run_of_only_rejected_groups_stops_naming_the_last_cause() -> None:
    """Every group rejected (episodes returning None or raising EpisodeRejected):
    ``max_failed_groups`` of them in a row stop the run with GroupsFailing naming the last
    cause. Before: ``max_failed_groups`` counted failures only, and such a run waited for a
    batch forever (a warning every 30 s)."""
    cfg, episode = _rejecting_controller(bound=5, every=0)
    engine = FakeEngine("e", random.Random(0), 0.01)
    async with Controller(cfg, episode, [engine], source=iter(range(10**9))) as ctl:
        with pytest.raises(RuntimeError) as err:
            await asyncio.wait_for(ctl.next_batch(), 30)
        assert ctl.counters["rejected"] >= 5 and ctl.counters["failed"] == 0
    cause = err.value.__cause__
    assert isinstance(cause, GroupsFailing), err.value
    msg = str(cause)
    assert "5 groups in a row failed or were rejected" in msg and "max_failed_groups" in msg
    # the last group's cause: its sample's EpisodeRejected (odd), or that it returned None
    last = re.search(r"the last: group (\d+) rejected: (.*)$", msg)
    assert last is not None, msg
    sample = int(last[1])  # a group's id is its sample's index here
    assert last[2] == (
        f"the agent gave up on sample {sample}" if sample % 2 else "every episode returned None"
    )


async def test_rejections_between_trained_groups_do_not_stop_the_run() -> None:
    """Rejected groups with trained ones between them (fewer than ``max_failed_groups`` in
    a row) go on: the streak restarts at every group that trains, and the last cause of a
    group that raised EpisodeRejected is what a stop would name."""
    # 2 rejected, 1 trained, ... (a generous bound: tokens of version 0 train at any step)
    cfg, episode = _rejecting_controller(bound=4, every=3, staleness=100)
    engine = FakeEngine("e", random.Random(0), 0.01)
    async with Controller(cfg, episode, [engine], source=iter(range(60))) as ctl:
        ctl.end_input()
        steps = 0
        with pytest.raises(NoMoreSamples):
            while True:
                batch = await asyncio.wait_for(ctl.next_batch(), 30)
                assert all(s % 3 == 0 for s in batch.samples)
                steps += 1
                await ctl.set_version(steps)
    assert ctl.counters["trained"] == 20 and ctl.counters["rejected"] == 40
