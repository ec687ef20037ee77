"""The embedded engine's batch KV cache under churn (rows joining, widening, leaving) and
its ``kv_after_update`` modes: every sampled log-prob equals a plain full forward's."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest
import torch

from asyncrl.engines.rollout.local.engine import LocalEngine, Request
from asyncrl.engines.rollout.local.kv import ROOM
from asyncrl.engines.rollout.local.sampling import SamplingParams
from tests.engines.rollout._pausing import pause_in_flight

EOS = 2


@pytest.fixture(params=[6, 48])
def engine(model: torch.nn.Module, request: pytest.FixtureRequest) -> Iterator[LocalEngine]:
    """Small batches (one attention call per step) and large ones (bucketed attention)."""
    eng = LocalEngine(model, {EOS}, max_batch_size=request.param, max_prefill_tokens=256)
    try:
        yield eng
    finally:
        eng.stop()


def _recompute(model: torch.nn.Module, prompt: list[int], out: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None]).squeeze(-1)


def _submit(engine: LocalEngine, rid: str, prompt: list[int], n: int) -> Request:
    loop = asyncio.get_running_loop()
    sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
    req = Request(rid, prompt, sp, loop, loop.create_future())
    engine.submit(req)
    return req


async def test_churn_keeps_every_logprob_exact(engine: LocalEngine, model: torch.nn.Module) -> None:
    """Rows of very different lengths join (some wider than the batch), grow past the
    buffers' spare room, leave in every order and are re-sorted for bucketed attention;
    each token is scored as without a cache."""
    rng = random.Random(0)
    vocab = model.config.vocab_size
    reqs, prompts = [], []
    for i in range(80):
        plen = rng.choice([2, 3, 5, 9, 40, 2 * ROOM + 7])  # wide joiners widen the window
        prompts.append([1] + [rng.randrange(3, vocab) for _ in range(plen - 1)])
        n = rng.choice([1, 2, 3, 8, 20, ROOM + 30])  # long ones outgrow the spare columns
        reqs.append(_submit(engine, f"r{i}", prompts[-1], n))
        if i % 13 == 12:
            await asyncio.sleep(0.01)  # later requests join a running batch
    done = await asyncio.gather(*(r.future for r in reqs))
    assert engine.stats["prefill_steps"] > 5 and engine.stats["decode_steps"] > ROOM
    if engine.max_batch_size > 16:
        assert engine.stats["bucketed_steps"] > 10 and engine.stats["sorts"] > 0
    for p, r in zip(prompts, done, strict=True):
        assert len(r.output_ids) == r.sampling.max_new_tokens
        torch.testing.assert_close(
            torch.tensor(r.logprobs), _recompute(model, p, r.output_ids), atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("mode", ["recompute", "keep"])
async def test_kv_after_update(model: torch.nn.Module, mode: str) -> None:
    """``recompute``: tokens after a mid-flight update are scored by the new weights over
    the whole prefix (re-prefill). ``keep``: no re-prefill; the prefix keeps the old
    weights' keys/values, so the new weights' full forward scores those tokens differently."""
    engine = LocalEngine(model, {EOS}, max_batch_size=4, kv_after_update=mode)
    old = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    new = [(n, p.detach() * 1.05) for n, p in model.named_parameters()]
    prompts = [[1, 3, 4], [1, 5, 6, 7, 8]]
    try:
        reqs = await pause_in_flight(
            engine,
            lambda: [_submit(engine, f"k{i}", p, 600) for i, p in enumerate(prompts)],
            3,
            "in_place",
        )
        before = [len(r.output_ids) for r in reqs]
        engine.load_weights(new, "1")
        engine.resume()
        done = await asyncio.gather(*(r.future for r in reqs))
        engine.load_weights(old, "0")  # the module-scoped model back as it was
        for p, r, b in zip(prompts, done, before, strict=True):
            assert r.min_version == "0" and len(r.output_ids) == 600
            assert r.versions == ["0"] * b + ["1"] * (600 - b)  # exact per token, both modes
            engine.load_weights(new, None)
            want = _recompute(model, p, r.output_ids)
            engine.load_weights(old, None)
            got = torch.tensor(r.logprobs)
            if mode == "recompute":
                torch.testing.assert_close(got[b:], want[b:], atol=1e-4, rtol=0)
            else:  # decoded over the old prefix cache: the new weights' scores differ
                assert (got[b + 1 :] - want[b + 1 :]).abs().max() > 1e-3
        assert engine.stats["retracted"] == (len(reqs) if mode == "recompute" else 0)
    finally:
        engine.load_weights(old, "0")
        engine.stop()
