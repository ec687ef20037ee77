"""The embedded engine prefills identical joiners once (a GRPO group's samples of one prompt)
and forks the keys/values to every row: the rows' tokens and log-probs are exactly those of
separate prefills, also across a weight update in flight and an abort resumed later."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from asyncrl.engines.rollout.local.engine import LocalEngine, Request
from asyncrl.engines.rollout.local.sampling import SamplingParams
from tests.engines.rollout._pausing import pause_in_flight

EOS = 2
PROMPT = [1, 5, 3, 9, 4, 4, 7, 3, 10, 6, 8, 3]
OTHER = [1, 7, 7, 3]


def _recompute(model: torch.nn.Module, prompt: list[int], out: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None]).squeeze(-1)


def _submit(engine: LocalEngine, rid: str, ids: list[int], **sp: Any) -> Request:
    loop = asyncio.get_running_loop()
    req = Request(rid, list(ids), SamplingParams(**sp), loop, loop.create_future())
    engine.submit(req)
    return req


async def _together(engine: LocalEngine, specs: list[tuple[list[int], dict[str, Any]]]) -> list:
    """Submit all of ``specs`` while paused, so they join in one prefill."""
    engine.pause("in_place")
    reqs = [_submit(engine, f"t{i}", ids, **sp) for i, (ids, sp) in enumerate(specs)]
    engine.resume()
    return reqs


async def test_shared_rows_match_separate_prefills(model: torch.nn.Module) -> None:
    """Greedy: a group of 6 identical prompts (plus another prompt between them) prefilled
    once gives every row the tokens and log-probs of a request prefilled alone. Sampled:
    the forked rows diverge, and each is scored as its own full forward (no shared state)."""
    engine = LocalEngine(model, {EOS}, max_batch_size=32)
    try:
        greedy = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
        alone = [
            await _submit(engine, f"a{i}", p, **greedy).future
            for i, p in enumerate([PROMPT, OTHER])
        ]
        assert engine.stats["prefill_shared"] == 0
        specs = [(PROMPT, greedy)] * 3 + [(OTHER, greedy)] + [(PROMPT, greedy)] * 3
        done = await asyncio.gather(*(r.future for r in await _together(engine, specs)))
        assert engine.stats["prefill_shared"] == 5  # 7 joiners, 2 distinct sequences
        for (ids, _), r in zip(specs, done, strict=True):
            ref = alone[0] if ids == PROMPT else alone[1]
            assert r.output_ids == ref.output_ids
            torch.testing.assert_close(r.logprobs, ref.logprobs, atol=1e-6, rtol=0)

        sampled = {"max_new_tokens": 60, "ignore_eos": True}
        done = await asyncio.gather(
            *(r.future for r in await _together(engine, [(PROMPT, sampled)] * 8))
        )
        assert engine.stats["prefill_shared"] == 12
        assert len({tuple(r.output_ids) for r in done}) > 1  # the forks went their own ways
        for r in done:
            torch.testing.assert_close(
                torch.tensor(r.logprobs), _recompute(model, PROMPT, r.output_ids), atol=1e-4, rtol=0
            )
    finally:
        engine.stop()


async def test_shared_rows_across_weight_update_and_abort_resume(model: torch.nn.Module) -> None:
    """A weight update lands while a forked group decodes (``recompute``: the group is
    re-prefilled, shared again, under the new weights; versions stay the oldest); one row is
    aborted and resumed as prompt + partial output: the same tokens as without the abort."""
    engine = LocalEngine(model, {EOS}, max_batch_size=32, kv_after_update="recompute")
    old = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    new = [(n, p.detach() * 1.03) for n, p in model.named_parameters()]
    greedy = {"max_new_tokens": 600, "temperature": 0, "ignore_eos": True}
    try:
        reqs = await pause_in_flight(
            engine, lambda: _together(engine, [(PROMPT, greedy)] * 4), 5, "in_place"
        )
        assert engine.abort("t3") == 1
        cut = await reqs[3].future
        before = [len(r.output_ids) for r in reqs[:3]]
        engine.load_weights(new, "1")
        engine.resume()
        done = await asyncio.gather(*(r.future for r in reqs[:3]))
        assert engine.stats["retracted"] == 3 and engine.stats["prefill_shared"] >= 3 + 2
        assert len({tuple(r.output_ids) for r in done}) == 1  # greedy rows stay identical
        engine.load_weights(old, None)
        prefix = _recompute(model, PROMPT, done[0].output_ids)
        engine.load_weights(new, None)
        want = _recompute(model, PROMPT, done[0].output_ids)
        for r, b in zip(done, before, strict=True):
            assert r.min_version == "0" and len(r.output_ids) == 600
            got = torch.tensor(r.logprobs)
            torch.testing.assert_close(got[:b], prefix[:b], atol=1e-4, rtol=0)
            torch.testing.assert_close(got[b:], want[b:], atol=1e-4, rtol=0)

        # the aborted row resumes (old weights again) with its exact remaining budget
        engine.load_weights(old, "0")
        n = len(cut.output_ids)
        assert cut.finish["type"] == "abort" and 5 <= n < 600
        rest = await _submit(
            engine, "resume", PROMPT + cut.output_ids, **{**greedy, "max_new_tokens": 600 - n}
        ).future
        whole = await _submit(engine, "whole", PROMPT, **greedy).future
        assert cut.output_ids + rest.output_ids == whole.output_ids
        torch.testing.assert_close(cut.logprobs + rest.logprobs, whole.logprobs, atol=1e-5, rtol=0)
    finally:
        engine.load_weights(old, "0")
        engine.stop()
