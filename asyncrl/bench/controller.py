"""Controller throughput: episodes/s through admission, grouping and hand-off, on one core.

``asyncrl bench controller [--episodes N] [--json PATH]``

The engine answers at once (a zero-latency in-process RolloutEngine), the reward
is a cheap sync function and the "trainer" takes each batch and announces the
next version at once, so the only cost measured is the controller's own: admission
under the staleness rule, one task per group, the episode coroutines with their
EpisodeContext, per-token versions, Trajectory construction, grouping, staleness
re-check and batch hand-off. Side by side, a naive controller doing the same work
the straightforward way (a task per episode, the reward in a worker thread, an
asyncio.Queue hand-off, a Condition for admission). Both run on one pinned core
with uvloop when installed.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from asyncrl import loops
from asyncrl.bench import bench_parser
from asyncrl.bench.common import write_json
from asyncrl.config import AlgoConfig, ControllerConfig, LocalRolloutConfig, RunConfig
from asyncrl.controllers.controller import Controller, NoMoreSamples
from asyncrl.controllers.episode import single_turn
from asyncrl.core import GenerateRequest, GenerateResult, Sample, Trajectory

TOKENS = 16


class InstantEngine:
    """A RolloutEngine that answers every request at once with ``TOKENS`` tokens."""

    url = "instant://0"

    def __init__(self) -> None:
        self.version = 0
        self._ids = list(range(TOKENS))
        self._lps = [-1.0] * TOKENS

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> GenerateResult:
        n = min(TOKENS, int(sampling_params["max_new_tokens"]))
        return GenerateResult(self._ids[:n], self._lps[:n], self.version, "length")

    async def generate_stream(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> AsyncIterator[GenerateResult]:
        yield await self.generate(input_ids, sampling_params, rid)

    async def generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return [await self.generate(r.input_ids, r.sampling_params) for r in requests]

    async def pause_generation(self, mode: str = "abort") -> None:
        pass

    async def continue_generation(self) -> None:
        pass

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        pass

    async def get_weight_version(self) -> str:
        return str(self.version)

    async def health(self) -> bool:
        return True

    async def close(self) -> None:
        pass


def reward(sample: Sample, response_ids: list[int]) -> float:
    return float(len(response_ids) % 2 == sample.id % 2)


def _samples(n: int) -> list[Sample]:
    return [Sample(prompt_ids=[1, 2, 3, 4, 5, 6, 7, 8], id=i) for i in range(n)]


async def run_ours(n_groups: int, batch: int, group: int, staleness: int) -> dict[str, float]:
    cfg = RunConfig(
        controller=ControllerConfig(batch_size=batch, max_staleness=staleness),
        algo=AlgoConfig(group_size=group),
        rollout=LocalRolloutConfig(max_new_tokens=TOKENS),
    )
    engine = InstantEngine()
    episodes = 0
    t0, c0 = time.perf_counter(), time.process_time()
    async with Controller(cfg, single_turn(reward), [engine], _samples(n_groups)) as ctl:
        ctl.end_input()
        while True:
            try:
                b = await ctl.next_batch()
            except NoMoreSamples:
                break
            episodes += sum(len(g) for g in b.groups)
            engine.version = b.step + 1
            await ctl.set_version(b.step + 1)
    return {
        "episodes": episodes,
        "seconds": time.perf_counter() - t0,
        "cpu_s": time.process_time() - c0,
    }


async def run_naive(n_groups: int, batch: int, group: int, staleness: int) -> dict[str, float]:
    """The straightforward design: same rule and outputs, none of the hot-path care."""
    engine = InstantEngine()
    samples = _samples(n_groups)
    ready: asyncio.Queue = asyncio.Queue()
    cond = asyncio.Condition()
    state = {"version": 0, "admitted": 0}

    async def episode(sample: Sample) -> Trajectory:
        res = await engine.generate(sample.prompt_ids, {"max_new_tokens": TOKENS}, rid="x")
        r = await asyncio.to_thread(reward, sample, res.output_ids)
        n = len(res.output_ids)
        return Trajectory(
            prompt_ids=np.asarray(sample.prompt_ids, np.int32),
            response_ids=np.asarray(res.output_ids, np.int32),
            behav_logprobs=np.asarray(res.logprobs, np.float32),
            versions=np.full(n, res.weight_version, np.int32),
            loss_mask=np.ones(n, np.uint8),
            reward=r,
            group_id=sample.id,
            episode_id=0,
        )

    async def run_group(sample: Sample) -> None:
        trajs = await asyncio.gather(*(asyncio.create_task(episode(sample)) for _ in range(group)))
        await ready.put(list(trajs))

    async def admit() -> None:
        tasks = []
        for s in samples:
            async with cond:
                cap = lambda: state["admitted"] < (staleness + state["version"] + 1) * batch  # noqa: E731
                await cond.wait_for(cap)
                state["admitted"] += 1
            tasks.append(asyncio.create_task(run_group(s)))
        await asyncio.gather(*tasks)

    t0, c0 = time.perf_counter(), time.process_time()
    admitter = asyncio.create_task(admit())
    episodes, step = 0, 0
    while episodes < n_groups * group:
        groups = [await ready.get() for _ in range(min(batch, n_groups - episodes // group))]
        for g in groups:
            assert step - min(int(t.versions.min()) for t in g) <= staleness
        episodes += sum(len(g) for g in groups)
        step += 1
        async with cond:
            state["version"] = step
            engine.version = step
            cond.notify_all()
    await admitter
    return {
        "episodes": episodes,
        "seconds": time.perf_counter() - t0,
        "cpu_s": time.process_time() - c0,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = bench_parser("controller", __doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=200_000, help="episodes per measured run")
    p.add_argument("--batch-size", type=int, default=64, help="groups per batch")
    p.add_argument("--group-size", type=int, default=8, help="episodes per group")
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--core", type=int, default=0, help="CPU core to pin to (-1: no pinning)")
    p.add_argument("--repeats", type=int, default=3, help="best of N runs")
    p.add_argument("--json", default=None, help="write results here")
    a = p.parse_args(argv)
    if a.core >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {a.core})
    n_groups = max(1, a.episodes // a.group_size)
    args = (n_groups, a.batch_size, a.group_size, a.max_staleness)
    rows: dict[str, dict[str, float]] = {}
    for name, fn in (("asyncrl", run_ours), ("naive", run_naive)):
        runs = [loops.run(fn(*args)) for _ in range(a.repeats)]
        best = min(runs, key=lambda r: r["seconds"])
        rows[name] = {
            **best,
            "episodes_per_s": best["episodes"] / best["seconds"],
            "episodes_per_cpu_s": best["episodes"] / best["cpu_s"],
        }
    out = {
        "episodes_per_s": rows["asyncrl"]["episodes_per_s"],
        "episodes_per_cpu_s": rows["asyncrl"]["episodes_per_cpu_s"],
        "naive_episodes_per_s": rows["naive"]["episodes_per_s"],
        "naive_episodes_per_cpu_s": rows["naive"]["episodes_per_cpu_s"],
        "speedup_vs_naive": rows["asyncrl"]["episodes_per_s"] / rows["naive"]["episodes_per_s"],
        "episodes": rows["asyncrl"]["episodes"],
        "batch_size": a.batch_size,
        "group_size": a.group_size,
        "max_staleness": a.max_staleness,
        "core": a.core,
    }
    print(
        f"{'controller':<10} {'episodes':>9} {'wall s':>8} {'cpu s':>8} {'ep/s':>9} {'ep/cpu-s':>9}"
    )
    for name, r in rows.items():
        print(
            f"{name:<10} {r['episodes']:>9.0f} {r['seconds']:>8.3f} {r['cpu_s']:>8.3f}"
            f" {r['episodes_per_s']:>9,.0f} {r['episodes_per_cpu_s']:>9,.0f}"
        )
    print(f"speedup vs naive: {out['speedup_vs_naive']:.1f}x (target: >= 20,000 episodes/s)")
    write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
