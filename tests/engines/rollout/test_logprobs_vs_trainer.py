"""Engine log-probs equal the trainer's recomputed log-probs (fp32, CPU, same weights/tokens)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from asyncrl.config import RunConfig
from asyncrl.engines.rollout.local.engine import Request, SamplingParams
from asyncrl.engines.rollout.local.server import load_engine
from asyncrl.engines.train.base import Seq
from asyncrl.engines.train.fsdp import FSDPEngine


async def test_engine_logprobs_equal_trainer_forward_batch(tiny_model_dir: Path) -> None:
    torch.set_num_threads(1)
    engine = load_engine(str(tiny_model_dir), "cpu", "float32", max_batch_size=4, seed=3)
    prompts = [[1, 3, 4, 5], [1, 9], [1, 6, 7, 8, 9, 10], [1, 4, 4], [1, 5, 3, 7, 2, 8, 8]]
    loop = asyncio.get_running_loop()
    try:
        reqs = [
            Request(
                str(i), p, SamplingParams(max_new_tokens=12 + 3 * i), loop, loop.create_future()
            )
            for i, p in enumerate(prompts)
        ]
        for r in reqs:  # 5 requests > max_batch_size 4: one joins a running batch
            engine.submit(r)
        await asyncio.gather(*(r.future for r in reqs))
    finally:
        engine.stop()
    trainer = FSDPEngine(str(tiny_model_dir), RunConfig())  # no process group: plain module
    seqs = [Seq(torch.tensor(r.input_ids + r.output_ids), len(r.input_ids)) for r in reqs]
    recomputed = trainer.forward_batch(seqs)
    for r, lp in zip(reqs, recomputed, strict=True):
        assert len(r.output_ids) > 0
        torch.testing.assert_close(torch.tensor(r.logprobs), lp.float(), atol=2e-5, rtol=1e-5)
