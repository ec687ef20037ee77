"""A multi-turn, tool-using episode driven through the embedding API.

    python examples/tool_episode.py            # starts an embedded engine with the tiny model
    python examples/tool_episode.py --url http://127.0.0.1:30000 --secret-file F  # a running one

The episode: the model reads ``<s> d1 d2 d3 =`` and writes up to 4 tokens (turn 1).
The digits it wrote are a call to a "calculator" tool, which answers with their sum
mod 10 followed by ``=`` — environment tokens, kept in the trajectory but masked
out of the loss. The model then writes 2 more tokens (turn 2); the reward is 1 if
its first token repeats the tool's answer. An episode whose turn 1 holds no digit
made no tool call and is rejected (returns None). The reward function is async
(awaited on the loop); a sync one would run off the loop.

The loop below is where your own trainer goes: take a batch, train on it, push the
new weights with :class:`asyncrl.WeightPusher` (it returns once the engines serve the
new version, and moves the controller's). Here no trainer runs: the model file's own
weights are pushed each step (real pushes, the same values), so the example runs in
seconds on a CPU; ``examples/embedding.py`` trains them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncrl
from asyncrl import Controller, EpisodeContext, Sample, Trajectory, WeightPusher, load_config


def vocabulary(model_path: str) -> dict[str, int]:
    tok = json.loads((Path(model_path) / "tokenizer.json").read_text())
    return dict(tok["model"]["vocab"])


def prompts(vocab: dict[str, int], seed: int = 0) -> Iterator[Sample]:
    rng = random.Random(seed)
    i = 0
    while True:
        digits = [str(rng.randrange(10)) for _ in range(3)]
        ids = [vocab["<s>"], *(vocab[d] for d in digits), vocab["="]]
        yield Sample(prompt_ids=ids, id=i)
        i += 1


def make_episode(vocab: dict[str, int]) -> Any:
    digit_of = {vocab[str(d)]: d for d in range(10)}

    def calculator(token_ids: list[int]) -> list[int] | None:
        """The tool: sum of the digits the model wrote, mod 10, then '='."""
        digits = [digit_of[t] for t in token_ids if t in digit_of]
        if not digits:
            return None
        return [vocab[str(sum(digits) % 10)], vocab["="]]

    async def reward(expected: int, response: list[int]) -> float:
        return float(bool(response) and response[0] == expected)

    async def episode(ctx: EpisodeContext, sample: Sample) -> Trajectory | None:
        turn1 = await ctx.generate(sample.prompt_ids, max_new_tokens=4)
        tool_out = calculator(turn1.output_ids)
        if tool_out is None:
            return None  # no tool call: reject the sample
        context = sample.prompt_ids + turn1.output_ids + tool_out
        turn2 = await ctx.generate(context, max_new_tokens=2)
        r = await ctx.reward(reward, tool_out[0], turn2.output_ids)
        return ctx.trajectory(sample.prompt_ids, [turn1, tool_out, turn2], r)

    return episode


async def drive(
    url: str, model_path: str, steps: int, batch_size: int, group_size: int, secret_file: str = ""
) -> dict:
    cfg = load_config(
        None,
        [
            f"--controller.batch_size={batch_size}",
            "--controller.max_staleness=1",
            f"--algo.group_size={group_size}",
            f"--rollout.urls={url}",
            "--rollout.max_new_tokens=8",
            "--rollout.pause_mode=abort",
            f"--cluster.secret_file={secret_file}",  # the engine's key ("": this process's)
        ],
    )
    await asyncrl.wait_healthy(cfg)  # an engine that refuses the key fails here, at once
    vocab = vocabulary(model_path)
    from safetensors.torch import load_file  # your trainer's weights stand here

    params = load_file(str(Path(model_path) / "model.safetensors"))
    async with Controller(cfg, episode=make_episode(vocab)) as ctl, WeightPusher(ctl) as weights:
        stream = prompts(vocab)
        ctl.submit(next(stream) for _ in range(steps * batch_size * 2))
        for step in range(steps):
            batch = await ctl.next_batch()
            # --- your trainer: train on batch.trajectories (loss_mask marks trained tokens) ---
            masked = sum(int((t.loss_mask == 0).sum()) for t in batch.trajectories)
            print(
                f"step {batch.step}: {len(batch.groups)} groups, reward {batch.reward_mean:.2f},"
                f" {masked} tool tokens masked, staleness {batch.staleness_max}"
            )
            await weights.push(params.items(), step + 1)  # engines serve version step + 1
        stats = ctl.stats()
    print("controller stats:", stats)
    return stats


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="a multi-turn tool-using episode via the embedding API")
    p.add_argument("--url", default=None, help="a running engine (default: start one)")
    p.add_argument("--secret-file", default="", help="the --url engine's key file (mode 0600)")
    p.add_argument("--model-path", default=None, help="default: the tiny model")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    a = p.parse_args(argv)
    model_path = a.model_path or str(asyncrl.ensure_tiny_model())
    engine = asyncrl.EngineProcess.start(model_path) if a.url is None else None
    url = engine.url if engine is not None else a.url
    try:
        return asyncio.run(
            drive(url, model_path, a.steps, a.batch_size, a.group_size, a.secret_file)
        )
    finally:
        if engine is not None:
            engine.stop()


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
