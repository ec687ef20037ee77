"""Evaluation during training: held-out prompts on the run's engines, beside training.

An eval sends each prompt ``k`` times at ``temperature`` (and once greedily) through the
controller's router — the same engines, the same pause gate for weight updates, the same
retries — as requests that belong to no group: they are never admitted (no staleness slot),
never batched and never trained. Training goes on meanwhile; the engines interleave both.
Every eval token reports the weight version that generated it, so a result names the
versions it measured (``eval/weight_version`` .. ``eval/weight_version_max``: with
``rollout.pause_mode = "in_place"`` a response in flight at a weight update finishes under
the new weights).

Metrics (one dict, keys ``eval/...``): ``reward_mean`` (over the sampled responses),
``pass@1`` and ``pass@k`` (the unbiased estimator of Chen et al. 2021 over each prompt's
``n = k`` samples, a sample passing when its reward is >= ``pass_threshold``, averaged over
prompts), ``response_len`` (mean generated tokens), ``greedy_reward`` / ``greedy_pass``
(one temperature-0 response per prompt), ``num_prompts``, ``wall_s``. When the prompts come
from more than one source (``sample.source``: ``eval.sources``), each source also gets
``eval/<source>/reward_mean``, ``pass@1``, ``pass@k``, ``response_len``, ``num_prompts`` (and
``greedy_pass`` with ``greedy``). A reward of several functions (``task.rewards``: an
object with ``score(sample, ids) -> (reward, {name: value})``) adds
``eval/reward/<name>_mean`` per function over the sampled responses.

:class:`Evaluator` runs them for ``asyncrl run`` (``[eval]``: before the first step, every
``every_steps`` versions, at the end); ``await ctl.evaluate(samples, reward, ...)`` runs one
from the embedding API.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from asyncrl.config import RunConfig
from asyncrl.controllers.episode import EpisodeContext, Gate, RewardFn, RewardRunner
from asyncrl.controllers.router import Router

if TYPE_CHECKING:
    from asyncrl.controllers.controller import Controller

__all__ = ["Evaluator", "by_source", "evaluate", "pass_at_k"]

log = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 1_000_003
"""The reverse task's eval split: its prompt stream seeded ``task.seed + this``."""

_ids = itertools.count(-1, -1)  # eval episode ids: negative, never a training episode's


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` passed: ``1 - C(n-c, k) / C(n, k)``
    (Chen et al. 2021, "Evaluating large language models trained on code", eq. 1)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


async def evaluate(
    router: Router,
    gate: Gate,
    samples: Sequence[Any],
    reward: RewardFn,
    *,
    k: int = 1,
    temperature: float = 1.0,
    greedy: bool = False,
    max_new_tokens: int = 16,
    pass_threshold: float = 1.0,
    sampling: dict[str, Any] | None = None,
    max_retries: int = 3,
) -> dict[str, float]:
    """One eval of ``samples`` (each with ``prompt_ids``) scored by ``reward`` (the one reward
    signature); returns the ``eval/...`` metrics of the module docstring."""
    if not samples:
        raise ValueError("an eval needs at least one prompt")
    t0 = time.perf_counter()
    base = {**(sampling or {}), "max_new_tokens": max_new_tokens}
    runner = RewardRunner(reward, 0.0)
    score = getattr(reward, "score", None)  # several functions (task.rewards): each one's too
    parts: list[dict[str, float]] = []

    async def one(sample: Any, temp: float, greedy: bool = False) -> tuple[float, int, int, int]:
        ctx = EpisodeContext(router, -1, next(_ids), base, max_retries, gate)
        gen = await ctx.generate(sample.prompt_ids, temperature=temp)
        if score is None:
            r = await runner(sample, gen.output_ids)
        else:
            r, mine = await score(sample, gen.output_ids)
            parts.extend([] if greedy else [mine])
        versions = gen.versions or [-1]
        return float(r), len(gen.output_ids), min(versions), max(versions)

    jobs = [one(s, temperature) for s in samples for _ in range(k)]
    if greedy:
        jobs += [one(s, 0.0, greedy=True) for s in samples]
    done = await asyncio.gather(*jobs)
    sampled, greedy_out = done[: len(samples) * k], done[len(samples) * k :]
    out = _scores(samples, sampled, k, pass_threshold, "eval/")
    out["eval/num_prompts"] = float(len(samples))
    for name in sorted({n for p in parts for n in p}):
        values = [p[name] for p in parts if name in p]
        out[f"eval/reward/{name}_mean"] = sum(values) / len(values)
    out.update(by_source(samples, sampled, [r for r, *_ in greedy_out], k, pass_threshold))
    if greedy_out:
        out["eval/greedy_reward"] = sum(r for r, *_ in greedy_out) / len(greedy_out)
        out["eval/greedy_pass"] = sum(r >= pass_threshold for r, *_ in greedy_out) / len(greedy_out)
        out["eval/greedy_response_len"] = sum(n for _, n, *_ in greedy_out) / len(greedy_out)
    out["eval/weight_version"] = float(min(v for *_, v, _ in done))
    out["eval/weight_version_max"] = float(max(v for *_, v in done))
    out["eval/wall_s"] = time.perf_counter() - t0
    return out


def by_source(
    samples: Sequence[Any],
    sampled: Sequence[tuple[float, int, int, int]],
    greedy: Sequence[float],
    k: int,
    pass_threshold: float,
) -> dict[str, float]:
    """The per-source breakdowns ``eval/<source>/...`` of one eval when its ``samples`` come
    from more than one source (``sample.source``; none: empty): ``sampled[i * k + j]`` is
    sample ``i``'s ``j``-th (reward, length, ...), ``greedy[i]`` its greedy reward (or empty)."""
    sources = [getattr(s, "source", "") for s in samples]
    out: dict[str, float] = {}
    if len(set(sources)) < 2:
        return out
    for name in sorted(set(sources)):
        idx = [i for i, src in enumerate(sources) if src == name]
        mine = [sampled[i * k + j] for i in idx for j in range(k)]
        out.update(_scores([samples[i] for i in idx], mine, k, pass_threshold, f"eval/{name}/"))
        out[f"eval/{name}/num_prompts"] = float(len(idx))
        if greedy:
            out[f"eval/{name}/greedy_pass"] = sum(greedy[i] >= pass_threshold for i in idx) / len(
                idx
            )
    return out


def _scores(
    samples: Sequence[Any],
    sampled: Sequence[tuple[float, int, int, int]],
    k: int,
    pass_threshold: float,
    prefix: str,
) -> dict[str, float]:
    """``reward_mean``, ``pass@1``, ``pass@k`` and ``response_len`` of ``samples`` from their
    ``k`` sampled results each (``sampled[i * k + j]``: (reward, length, ...)), keys under
    ``prefix``."""
    passes = [
        sum(r >= pass_threshold for r, *_ in sampled[i * k : (i + 1) * k])
        for i in range(len(samples))
    ]
    return {
        f"{prefix}reward_mean": sum(r for r, *_ in sampled) / len(sampled),
        f"{prefix}pass@1": sum(pass_at_k(k, c, 1) for c in passes) / len(samples),
        f"{prefix}pass@{k}": sum(pass_at_k(k, c, k) for c in passes) / len(samples),
        f"{prefix}response_len": sum(n for _, n, *_ in sampled) / len(sampled),
    }


class Evaluator:
    """``asyncrl run``'s evals (``[eval]``): :meth:`start` once the controller runs,
    :meth:`version` after each new weight version, :meth:`finish` at the end. Each eval is a
    background task (at most one at a time: a version that comes while one runs is skipped)
    whose error surfaces at the next call; ``write`` gets each result with ``step`` = the
    version asked for and ``eval/skipped`` = how many versions asked for are, so far, not
    evaluated (a version skipped by the schedule and then evaluated at the end is not)."""

    def __init__(
        self,
        cfg: RunConfig,
        ctl: Controller,
        samples: Iterable[Any],
        reward: RewardFn,
        write: Callable[[dict[str, Any]], None],
    ):
        self.cfg = cfg.eval
        self.ctl = ctl
        self.samples = list(samples)
        self.reward = reward
        self.write = write
        self.budget = cfg.eval.max_new_tokens or cfg.generation_budget()
        self.running: asyncio.Task | None = None
        self.missed: set[int] = set()  # versions skipped while an eval ran
        self.done: set[int] = set()

    def start(self) -> None:
        if self.cfg.before_train:
            self._launch(0)

    def version(self, v: int) -> None:
        every = self.cfg.every_steps
        if every and v % every == 0:
            self._launch(v)

    async def finish(self, v: int) -> None:
        """Wait for a running eval; then evaluate version ``v`` if ``at_end`` (and not done)."""
        if self.running is not None:
            await self.running
        if self.cfg.at_end and v not in self.done:
            self._launch(v)
            assert self.running is not None
            await self.running

    async def close(self) -> None:
        if self.running is not None and not self.running.done():
            self.running.cancel()
            await asyncio.gather(self.running, return_exceptions=True)

    def _launch(self, v: int) -> None:
        if self.running is not None and self.running.done():
            self.running.result()  # an eval that failed fails the run here
        if self.running is not None and not self.running.done():
            self.missed.add(v)
            log.warning("eval of version %d skipped: the previous eval is still running", v)
            return
        self.done.add(v)
        self.running = asyncio.get_running_loop().create_task(self._run(v), name=f"eval-{v}")

    async def _run(self, v: int) -> None:
        c = self.cfg
        metrics = await self.ctl.evaluate(
            self.samples,
            self.reward,
            k=c.k,
            temperature=c.temperature,
            greedy=c.greedy,
            max_new_tokens=self.budget,
            pass_threshold=c.pass_threshold,
        )
        skipped = len(self.missed - self.done)
        self.write({"step": v, **metrics, "eval/skipped": float(skipped)})
