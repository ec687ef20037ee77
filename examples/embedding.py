"""README's "Embedding the controller", whole and runnable: your own trainer, your own loop.

    python examples/embedding.py                  # starts `asyncrl serve` (the tiny model)
    python examples/embedding.py --url http://127.0.0.1:30000 --secret-file F [--model-path DIR]

``--url``: an engine started by hand (``asyncrl serve --port 30000 --secret-file F``; one
started without ``--secret-file`` writes its key to the file it logs, pass that one); the
example hands ``F`` to the controller as ``cluster.secret_file`` (docs/embedding.md).

The part between the ``[readme]`` markers is README's example, word for word (a test
checks that they match and runs this file). The episode: the model reads ``<s> a b c =``
and writes up to 4 tokens: its call to a calculator tool, which answers with the sum of
the digits it wrote, mod 10, and ``=`` (environment tokens: in the trajectory, masked
out of the loss). The model then writes 2 more tokens; the reward is 1 when the first
is ``(a + b + c) mod 10``. A turn 1 with no digit made no tool call: the episode returns
None and the sample is rejected.

The trainer is plain PyTorch: the tiny model loaded with ``transformers``, one
policy-gradient step per batch (group-mean baseline, GRPO-style), and its weights
pushed into the engine after every step with :class:`asyncrl.WeightPusher`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AutoModelForCausalLM

import asyncrl

# [readme]
from asyncrl import Batch, Controller, Sample, WeightPusher, load_config, wait_healthy


async def episode(ctx, sample):  # thousands run concurrently
    call = await ctx.generate(sample.prompt_ids, max_new_tokens=4)  # turn 1: a tool call
    tool_out = calculator(call.output_ids)  # environment tokens: masked out of the loss
    if tool_out is None:
        return None  # no tool call: the sample is rejected
    context = sample.prompt_ids + call.output_ids + tool_out
    final = await ctx.generate(context, max_new_tokens=2)  # turn 2: the answer
    reward = await ctx.reward(score, sample, final.output_ids)  # fn(sample, response_ids)
    return ctx.trajectory(sample.prompt_ids, [call, tool_out, final], reward)


async def main(url: str, policy: Policy, steps: int = 5, secret_file: str = "") -> dict[str, int]:
    """``policy``: your trainer (here plain PyTorch: ``Policy`` in examples/embedding.py);
    ``secret_file``: the engine's key (empty: this process's secret, which an engine this
    program started was handed)."""
    args = [f'--rollout.urls=["{url}"]', "--controller.batch_size=4"]
    cfg = load_config(None, [*args, f"--cluster.secret_file={secret_file}"])
    await wait_healthy(cfg)  # the engines answer (one that refuses the secret: at once)
    async with Controller(cfg, episode=episode) as ctl, WeightPusher(ctl) as weights:
        ctl.submit(prompts(steps * 8))
        for step in range(steps):
            batch: Batch = await ctl.next_batch()  # groups that fit the staleness bound
            loss = policy.train(batch)
            # every engine now serves the new weights as version step + 1; admission goes on
            await weights.push(policy.model.state_dict().items(), step + 1)
            print(f"step {batch.step}: reward {batch.reward_mean:.2f} loss {loss:+.3f}")
        return ctl.stats()


# [readme]
ID = {w: i for i, w in enumerate(asyncrl.TINY_VOCAB)}  # the tiny model's vocabulary
DIGIT = {ID[str(d)]: d for d in range(10)}


def prompts(n: int, seed: int = 0) -> Iterator[Sample]:
    """``<s> a b c =``; the answer is ``(a + b + c) mod 10``."""
    rng = random.Random(seed)
    for i in range(n):
        digits = [rng.randrange(10) for _ in range(3)]
        ids = [ID["<s>"], *(ID[str(d)] for d in digits), ID["="]]
        yield Sample(prompt_ids=ids, answer=sum(digits) % 10, id=i)


def calculator(token_ids: list[int]) -> list[int] | None:
    """The tool: the sum of the digits the model wrote, mod 10, then ``=``; None if none."""
    digits = [DIGIT[t] for t in token_ids if t in DIGIT]
    if not digits:
        return None
    return [ID[str(sum(digits) % 10)], ID["="]]


def score(sample: Sample, response_ids: list[int]) -> float:
    """The reward function: 1 when the answer's first token is the right digit."""
    return float(response_ids[:1] == [ID[str(sample.answer)]])


class Policy:
    """A minimal trainer: the model, Adam, one policy-gradient step per batch."""

    def __init__(self, model_path: str, lr: float = 1e-3):
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)

    def train(self, batch: Batch) -> float:
        """Maximise ``(reward - group mean) * log p(trained tokens)``; returns the loss."""
        total = 0.0
        for group in batch.groups:
            mean = sum(t.reward for t in group) / len(group)
            for t in group:
                loss = -(t.reward - mean) * self._logprob(t) / len(batch.trajectories)
                loss.backward()
                total += float(loss.detach())
        self.opt.step()
        self.opt.zero_grad()
        return total

    def _logprob(self, t: Any) -> torch.Tensor:
        ids = torch.tensor([[*t.prompt_ids, *t.response_ids]])
        logits = self.model(ids).logits[0, len(t.prompt_ids) - 1 : -1]
        response = torch.as_tensor(t.response_ids, dtype=torch.long)
        logp = logits.log_softmax(-1).gather(-1, response[:, None])[:, 0]
        return (logp * torch.as_tensor(t.loss_mask, dtype=logp.dtype)).sum()  # tool tokens: 0


def cli(argv: list[str] | None = None) -> dict[str, int]:
    p = argparse.ArgumentParser(description="README's embedding example: your trainer, your loop")
    p.add_argument("--url", default=None, help="a running engine (default: start one)")
    p.add_argument(
        "--secret-file",
        default="",
        help="the file (mode 0600) holding the --url engine's key (asyncrl serve --secret-file)",
    )
    p.add_argument("--model-path", default=None, help="default: the tiny model")
    p.add_argument("--steps", type=int, default=5, help="train steps (default 5)")
    a = p.parse_args(argv)
    model_path = a.model_path or str(asyncrl.ensure_tiny_model())
    engine = asyncrl.EngineProcess.start(model_path) if a.url is None else None
    url = engine.url if engine is not None else a.url
    try:
        stats = asyncio.run(main(url, Policy(model_path), a.steps, a.secret_file))
    finally:
        if engine is not None:
            engine.stop()
    print(json.dumps(stats))
    return stats


if __name__ == "__main__":
    sys.exit(0 if cli() else 1)
