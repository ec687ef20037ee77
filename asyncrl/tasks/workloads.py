"""Built-in learning workloads where asynchrony pays: long-tailed generation and agents waiting
on a slow tool. Each is a sample stream plus an episode (the episode API), learnt by the tiny
default model on a CPU in minutes, with a verifiable reward in [0, 1] (maximum 1).

- ``longtail`` (:class:`LongTail`), the regime of reasoning RL: the reverse task (``<s> 3 1 =``
  -> ``1 3``), each response continuing for a length drawn per episode from a Pareto
  distribution (scale ``min_len``, shape ``alpha``, capped at ``max_len``; ``ignore_eos``), as
  chains of thought vary: with the defaults half the responses are <= 8 tokens and ~1 in 64
  reaches the cap of 256, so a synchronous step waits for its longest response while the
  engine decodes an almost empty batch. Reward: the reverse task's partial credit on the
  response's first ``num_digits`` tokens (the answer); every generated token is trained on.
- ``agentic`` (:class:`Agentic`): ``turns`` rounds of the reverse task in one multi-turn
  episode. After each answer but the last the episode calls a tool, whose reply (the next
  question, ``<s> 5 2 =``) enters the context as environment tokens (masked out of the
  loss). The tool waits — ``asyncio.sleep``, no CPU — for a latency drawn from a Pareto
  distribution (scale ``latency_min_s``, shape ``alpha``, capped at ``latency_max_s``), as a
  sandbox, search or environment service does. Reward: the mean partial credit of the turns.

``asyncrl run --task.name=longtail`` / ``--task.name=agentic`` trains on them
(``asyncrl.task_factory.build_task``; knobs ``task.longtail.*`` / ``task.agentic.*``, and the
defaults a workload changes, such as the engine's context length: see
``asyncrl.config.task.LongTailTaskConfig``). Both streams are deterministic in ``seed``: a
group's lengths (``longtail``) live in its sample, and a tool call's latency (``agentic``) is
seeded by the sample, the episode's index in its group and the turn, so a synchronous and an
asynchronous run see the same workload.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Iterator
from typing import Any, Literal

from asyncrl.config import AgenticTaskConfig, LongTailTaskConfig
from asyncrl.controllers.episode import EpisodeContext
from asyncrl.core import Sample, Trajectory
from asyncrl.tasks.reverse import ReverseTask

__all__ = [
    "WORKLOADS",
    "Agentic",
    "LongTail",
    "Workload",
    "pareto",
]

WorkloadName = Literal["longtail", "agentic"]
WORKLOADS: tuple[WorkloadName, ...] = ("longtail", "agentic")


def pareto(rng: random.Random, scale: float, alpha: float, cap: float) -> float:
    """A Pareto(``alpha``) draw of scale ``scale`` (its minimum), capped at ``cap``."""
    return min(cap, scale * (1.0 - rng.random()) ** (-1.0 / alpha))


def _credit(output: list[int], answer: list[int]) -> float:
    """The reverse task's partial credit: the fraction of answer positions right."""
    return sum(1 for a, b in zip(output, answer, strict=False) if a == b) / len(answer)


class LongTail:
    """Reverse digits, then continue for a heavy-tailed number of tokens (see the module)."""

    def __init__(self, model_path: str, group_size: int, cfg: LongTailTaskConfig):
        """``cfg``: ``task.seed``, ``task.num_digits`` and the knobs of ``task.longtail``
        (the config checks ``min_len >= num_digits``)."""
        self.task = ReverseTask.from_tokenizer_dir(model_path, cfg.num_digits, cfg.seed)
        self.seed, self.group_size = cfg.seed, group_size
        lt = cfg.longtail
        self.min_len, self.alpha, self.max_len = lt.min_len, lt.alpha, lt.max_len

    def samples(self) -> Iterator[Sample]:
        """The reverse task's prompts; ``answer = [digits reversed, one length per episode]``."""
        rng = random.Random(self.seed + 1)
        for s in self.task.samples():
            lens = [
                math.ceil(pareto(rng, self.min_len, self.alpha, self.max_len))
                for _ in range(self.group_size)
            ]
            yield Sample(prompt_ids=s.prompt_ids, answer=[s.answer, lens], id=s.id)

    async def episode(self, ctx: EpisodeContext, sample: Sample) -> Trajectory:
        answer, lens = sample.answer
        n = lens[ctx.episode_id % len(lens)]  # a group's episodes have consecutive ids
        gen = await ctx.generate(sample.prompt_ids, max_new_tokens=n, ignore_eos=True)
        return ctx.trajectory(sample.prompt_ids, [gen], _credit(gen.output_ids, answer))


class Agentic:
    """Multi-turn reverse task with a slow tool between the turns (see the module)."""

    def __init__(self, model_path: str, group_size: int, cfg: AgenticTaskConfig):
        """``cfg``: ``task.seed``, ``task.num_digits`` and the knobs of ``task.agentic``
        (the config checks ``turns >= 2``: a tool call between turns)."""
        ag = cfg.agentic
        self.task = ReverseTask.from_tokenizer_dir(model_path, cfg.num_digits, cfg.seed)
        self.seed, self.group_size, self.turns = cfg.seed, group_size, ag.turns
        self.latency = (ag.latency_min_s, ag.alpha, ag.latency_max_s)
        self.tool_calls = 0  # calls made (for tests and reports)
        self.tool_wait_s = 0.0  # total time the tool slept

    def samples(self) -> Iterator[Sample]:
        """``turns`` questions per sample: ``answer = [[question ids, answer ids], ...]``;
        the first question is the prompt."""
        it = self.task.samples()
        i = 0
        while True:
            qs = [next(it) for _ in range(self.turns)]
            yield Sample(prompt_ids=qs[0].prompt_ids, answer=[[q.prompt_ids, q.answer] for q in qs],
                         id=i)  # fmt: skip
            i += 1

    async def tool(self, sample: Sample, index: int, turn: int) -> list[int]:
        """The next question, after a long-tailed wait (seeded by sample, episode and turn)."""
        rng = random.Random(f"{self.seed}:{sample.id}:{index}:{turn}")
        wait = pareto(rng, *self.latency)
        self.tool_calls += 1
        self.tool_wait_s += wait
        await asyncio.sleep(wait)
        return list(sample.answer[turn + 1][0])

    async def episode(self, ctx: EpisodeContext, sample: Sample) -> Trajectory:
        history = list(sample.prompt_ids)
        turns: list[Any] = []
        credit = 0.0
        for turn, (_, answer) in enumerate(sample.answer):
            gen = await ctx.generate(history, max_new_tokens=len(answer) + 1)
            credit += _credit(gen.output_ids, answer)
            turns.append(gen)
            history += gen.output_ids
            if turn + 1 < len(sample.answer):
                reply = await self.tool(sample, ctx.episode_id % self.group_size, turn)
                turns.append(reply)
                history += reply
        return ctx.trajectory(sample.prompt_ids, turns, credit / len(sample.answer))


Workload = LongTail | Agentic
