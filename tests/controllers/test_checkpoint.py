"""Controller checkpoints: snapshot -> msgpack -> resume continues exactly.

Against a real embedded engine (in this process, tests/inproc.py): episodes interrupted
mid-generation (the engine paused with abort, as a weight update does) are checkpointed with
their tokens, log-probs and per-token versions; the resumed controller replays their journals and
the engine generates only the tokens that were missing. On test doubles: the data
stream continues where it stopped and every sample is trained exactly once across a
checkpoint, with ready and running groups carried over.
"""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from asyncrl.config import AlgoConfig, ControllerConfig, LocalRolloutConfig, RunConfig
from asyncrl.controllers.controller import Controller, NoMoreSamples
from asyncrl.controllers.episode import EpisodeContext
from asyncrl.controllers.state import ControllerState
from asyncrl.core import Sample
from asyncrl.engines.rollout.local.inproc import InProcEngine
from tests.controllers.fakes import FakeEngine, run_virtual

TOOL = [13, 13]


async def _two_turns(ctx: EpisodeContext, sample: Sample):
    """Turn 1, tool tokens, turn 2: a journal of two generate calls."""
    t1 = await ctx.generate(sample.prompt_ids, max_new_tokens=6, ignore_eos=True)
    ids = [*sample.prompt_ids, *t1.output_ids, *TOOL]
    t2 = await ctx.generate(ids, ignore_eos=True)
    reward = sum(t2.output_ids[:4]) / 100
    return ctx.trajectory(sample.prompt_ids, [t1, TOOL, t2], reward)


def _tokens(engine: InProcEngine) -> int:
    return int(engine.engine.stats["tokens"])


def _samples(n: int) -> list[Sample]:
    return [Sample(prompt_ids=[1, 3 + i % 10, 4, 14], answer=None, id=i) for i in range(n)]


async def test_interrupted_episodes_resume_with_their_tokens(engine: InProcEngine) -> None:
    budget = 800
    cfg = RunConfig(
        controller=ControllerConfig(batch_size=3, max_staleness=1, batch_requests=False),
        algo=AlgoConfig(group_size=2),
        rollout=LocalRolloutConfig(max_new_tokens=budget),
    )
    client = engine
    try:
        await client.update_weight_version("3")
        start = _tokens(engine)
        ctl = Controller(cfg, _two_turns, [client], _samples(3), start_version=3)
        async with ctl:
            # 6 x 6 turn-1 tokens, then every episode is decoding turn 2; its budget (800) is far
            # more than the engine decodes between two polls, even on a loaded machine
            while _tokens(engine) < start + 90:
                await asyncio.sleep(0.01)
            await client.pause_generation("abort")  # partial outputs come back to the episodes
            interrupted = False
            for _ in range(3000):
                snap = ctl.snapshot()
                interrupted = len(snap.running) == 3 and all(
                    len(e.calls) == 2
                    and e.calls[-1].finish_reason == "partial"
                    and e.calls[-1].output_ids
                    for g in snap.running
                    for e in g.episodes
                )
                if interrupted:
                    break
                await asyncio.sleep(0.01)
            assert interrupted, f"episodes not all interrupted in turn 2: {snap.running}"
            data = msgspec.msgpack.encode(ctl.snapshot())
        await client.abort_request(abort_all=True)  # the closed episodes' queued requests
        await client.update_weight_version("4")  # "the checkpoint's weights"
        await client.continue_generation()
        state = msgspec.msgpack.decode(data, type=ControllerState)
        assert len(state.running) == 3 and state.drawn == 3 and state.kept_tokens > 0
        kept = {e.episode_id: e.calls for g in state.running for e in g.episodes}
        before = _tokens(engine)
        ctl2 = Controller(
            cfg,
            _two_turns,
            [client],
            _samples(3),
            start_version=4,
            resume=state,
            sample_type=Sample,
        )
        async with ctl2:
            ctl2.end_input()
            batch = await asyncio.wait_for(ctl2.next_batch(), 300)
            assert ctl2.resumed == {"groups": 3, "episodes": 6, "kept_tokens": state.kept_tokens}
            generated = _tokens(engine) - before
            try:
                await ctl2.next_batch()
                raise AssertionError("only the 3 checkpointed groups should be left")
            except NoMoreSamples:
                pass
    finally:
        await client.continue_generation()  # the module's engine serves the next test
    assert batch.step == 3 and len(batch.trajectories) == 6
    total = 0
    for t in batch.trajectories:
        t1, t2 = kept[t.episode_id]
        n1 = len(t1.output_ids)
        resp, vers = t.response_ids.tolist(), t.versions.tolist()
        assert resp[:n1] == t1.output_ids and vers[:n1] == t1.versions  # turn 1 replayed
        assert resp[n1 : n1 + 2] == TOOL and t.loss_mask[n1 : n1 + 2].tolist() == [0, 0]
        turn2 = resp[n1 + 2 :]
        assert turn2[: len(t2.output_ids)] == t2.output_ids  # kept tokens, not regenerated
        assert vers[n1 + 2 : n1 + 2 + len(t2.output_ids)] == t2.versions  # their versions
        assert set(vers[n1 + 2 + len(t2.output_ids) :]) == {4}  # the rest under the new weights
        assert len(turn2) == budget
        total += len(turn2) - len(t2.output_ids)
    assert generated == total  # the engine produced exactly the missing tokens


def test_data_stream_continues_and_every_sample_trains_once() -> None:
    cfg = RunConfig(
        controller=ControllerConfig(batch_size=2, max_staleness=2),
        algo=AlgoConfig(group_size=2),
        rollout=LocalRolloutConfig(max_new_tokens=6),
    )

    async def episode(ctx: EpisodeContext, sample: int):
        gen = await ctx.generate([1, 2 + sample % 7])
        return ctx.trajectory([1], [gen], float(sample))

    async def go() -> list[int]:
        engine = FakeEngine("e", random.Random(1), 0.05)
        trained: list[int] = []
        async with Controller(cfg, episode, [engine], range(40)) as ctl:
            for step in range(3):
                b = await ctl.next_batch()
                trained += b.samples
                await asyncio.sleep(0.07)  # groups are mid-generation at the snapshot
                engine.version = step + 1
                await ctl.set_version(step + 1)
            state = msgspec.msgpack.decode(
                msgspec.msgpack.encode(ctl.snapshot()), type=ControllerState
            )
            before = ctl.stats()
        assert state.step == 3 and state.running and before["admitted_total"] == state.admitted
        resumed = Controller(
            cfg, episode, [engine], range(40), start_version=3, resume=state, sample_type=int
        )
        async with resumed as ctl:
            assert {k: ctl.stats()[k] for k in ("admitted_total", "step", "trained")} == {
                k: before[k] for k in ("admitted_total", "step", "trained")
            }
            for step in range(3, 10):
                b = await ctl.next_batch()
                assert b.step == step
                trained += b.samples
                engine.version = step + 1
                await ctl.set_version(step + 1)
        return trained

    trained = run_virtual(go())
    assert sorted(trained) == list(range(len(trained)))  # none skipped, none twice
    assert len(trained) == 20


class _Handle:
    """A payload msgpack cannot encode (an arbitrary object)."""


def _cfg() -> RunConfig:
    return RunConfig(
        controller=ControllerConfig(batch_size=1, max_staleness=0),
        algo=AlgoConfig(group_size=1),
        rollout=LocalRolloutConfig(max_new_tokens=4),
    )


async def _one_turn(ctx: EpisodeContext, sample: Sample):
    gen = await ctx.generate(sample.prompt_ids)
    return ctx.trajectory(sample.prompt_ids, [gen], 0.0)


def test_an_uncheckpointable_sample_is_refused_at_submit_naming_field_and_type() -> None:
    async def go() -> None:
        engine = FakeEngine("e", random.Random(1), 0.05)
        async with Controller(_cfg(), _one_turn, [engine]) as ctl:
            good = Sample(prompt_ids=[1, 2], answer={"digits": [3, 4], "n": (2, 1.5)}, id=0)
            bad = Sample(prompt_ids=[1, 2], answer=["x", {"lengths": _Handle()}], id=7)
            with pytest.raises(TypeError) as err:
                ctl.submit([good, bad])
            msg = str(err.value)
            assert "Sample.answer[1]['lengths']" in msg and "_Handle" in msg, msg
            assert "sample 7" in msg and "msgspec Structs" in msg, msg
            assert ctl.stats()["queued"] == 0  # a refused submit queues none of its samples
            ctl.submit([good])  # plain data is accepted and checkpointed
            await ctl.next_batch()
            assert msgspec.msgpack.encode(ctl.snapshot())

    run_virtual(go())


def test_an_uncheckpointable_sample_from_the_source_stops_the_controller() -> None:
    samples = [Sample(prompt_ids=[1, 2], answer=_Handle(), id=3)]

    async def go() -> None:
        engine = FakeEngine("e", random.Random(1), 0.05)
        async with Controller(_cfg(), _one_turn, [engine], samples) as ctl:
            with pytest.raises(RuntimeError) as err:
                await ctl.next_batch()
            cause = err.value.__cause__
            assert isinstance(cause, TypeError) and "Sample.answer is a _Handle" in str(cause)

    run_virtual(go())


class _InTransit:
    """``engine`` with one request held "on the wire" (``hold``): it passed the controller's
    gate, and reaches the engine only once the engine was paused (``paused``)."""

    def __init__(self, engine: InProcEngine):
        self.inner = engine
        self.hold = False
        self.in_transit = asyncio.Event()
        self.paused = asyncio.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def generate(self, input_ids: list[int], sampling_params: dict, rid: str | None = None):
        if self.hold:
            self.hold = False
            self.in_transit.set()
            await self.paused.wait()
        return await self.inner.generate(input_ids, sampling_params, rid)

    async def pause_generation(self, mode: str = "abort") -> None:
        await self.inner.pause_generation(mode)
        self.paused.set()


async def test_a_stop_answers_a_request_that_reaches_its_engine_after_the_abort(
    engine: InProcEngine,
) -> None:
    """``Controller.interrupt`` (a run's stop): a request that passed the gate before it
    closed and reaches the engine after the abort is answered, and the interrupt returns
    True at once — with the engines held paused while it waited, such a request was never
    answered and every stop of a busy multi-turn run waited out the whole timeout (120 s)."""

    async def turns(ctx: EpisodeContext, sample: Sample):
        ids, parts = list(sample.prompt_ids), []
        for _ in range(50):
            out = await ctx.generate(ids, max_new_tokens=2, ignore_eos=True)
            parts += [out, TOOL]
            ids += [*out.output_ids, *TOOL]
        return ctx.trajectory(sample.prompt_ids, parts[:-1], 0.0)

    cfg = RunConfig(
        controller=ControllerConfig(batch_size=1, max_staleness=1, batch_requests=False),
        algo=AlgoConfig(group_size=2),
        rollout=LocalRolloutConfig(max_new_tokens=64),
    )
    wire = _InTransit(engine)
    try:
        ctl = Controller(cfg, turns, [wire], _samples(1))  # type: ignore[list-item]
        async with ctl:
            wire.hold = True
            await asyncio.wait_for(wire.in_transit.wait(), 60)
            answered = await asyncio.wait_for(ctl.interrupt(timeout_s=30), 60)
            assert answered, "the request that reached the paused engine was never answered"
            assert ctl._gate.inflight == 0
    finally:
        await engine.continue_generation()  # the module's engine serves the next test
