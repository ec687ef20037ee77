"""The embedded engine's KV buffers across batches: an emptied batch's buffers serve the next
batch when they fit (no allocation per batch), whatever they held before; leavers are moved
in one indexed copy. Every sampled log-prob still equals a plain full forward's."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest
import torch
from transformers import DynamicCache

from asyncrl.engines.rollout.local.engine import LocalEngine, Request
from asyncrl.engines.rollout.local.kv import BatchCache
from asyncrl.engines.rollout.local.sampling import SamplingParams
from tests.engines.rollout._pausing import pause_in_flight

EOS = 2


@pytest.fixture
def engine(model: torch.nn.Module) -> Iterator[LocalEngine]:
    eng = LocalEngine(model, {EOS}, max_batch_size=32, context_length=512)
    try:
        yield eng
    finally:
        eng.stop()


async def _wave(
    engine: LocalEngine, model: torch.nn.Module, plens: list[int], n: int, seed: int
) -> None:
    """Requests of prompt lengths ``plens`` (``n`` tokens each) at once; every log-prob is
    checked against a full forward of its sequence."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    reqs = []
    for i, plen in enumerate(plens):
        prompt = [1] + [rng.randrange(3, model.config.vocab_size) for _ in range(plen - 1)]
        sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
        reqs.append(Request(f"w{seed}-{i}", prompt, sp, loop, loop.create_future()))
    engine.submit_all(reqs)
    for r in await asyncio.gather(*(r.future for r in reqs)):
        assert len(r.output_ids) == n
        with torch.no_grad():
            ids = torch.tensor([r.input_ids + r.output_ids])
            logits = model(ids).logits[0, len(r.input_ids) - 1 : -1].float()
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.output_ids)[:, None])
        torch.testing.assert_close(torch.tensor(r.logprobs), want.squeeze(-1), atol=1e-4, rtol=0)


def _buffers(engine: LocalEngine) -> list[int]:
    assert engine._spare is not None and engine._kv is None
    return [layer._kbuf.data_ptr() for layer in engine._spare._glayers]


async def test_a_drained_batch_hands_its_buffers_to_the_next(
    engine: LocalEngine, model: torch.nn.Module
) -> None:
    """Short batches that drain reuse one set of buffers, even filled with NaN in between
    (nothing outside a batch's written window is read), also a batch of fewer rows; a much
    wider batch gets new ones,
    and a narrow batch after it does not keep four times the columns it needs."""
    await _wave(engine, model, [5, 7, 3, 5, 5, 6, 2, 5], 4, seed=0)
    first = _buffers(engine)
    with torch.inference_mode():  # the engine's cache tensors are inference tensors
        for layer in engine._spare._glayers:  # type: ignore[union-attr]
            layer._kbuf.fill_(float("nan"))
            layer._vbuf.fill_(float("nan"))
    await _wave(engine, model, [6, 4, 4, 8, 2, 6], 5, seed=1)  # different widths: padding
    assert _buffers(engine) == first
    await _wave(engine, model, [4], 3, seed=4)  # one row: the spare rows are kept
    assert _buffers(engine) == first
    await _wave(engine, model, [300, 9], 3, seed=2)
    wide = _buffers(engine)
    assert wide != first
    await _wave(engine, model, [5, 5, 4], 3, seed=3)
    assert _buffers(engine) != wide
    assert engine._spare._glayers[0]._kbuf.shape[-2] < 300  # type: ignore[union-attr]


def test_drop_moves_each_kept_row_whole() -> None:
    """Rows leaving in any set: each kept row's keys/values and length are its own, in the
    returned order; padding-only leading columns are trimmed."""
    rng = random.Random(0)
    for trial in range(30):
        rows = rng.randrange(2, 12)
        lens = [rng.randrange(1, 9) for _ in range(rows)]
        width = max(lens)
        cache, keys = DynamicCache(), []
        for layer in range(2):
            k = torch.randn(rows, 2, width, 4)
            keys.append(k)
            cache.update(k, k + 100, layer)
        kv = BatchCache(cache, lens, max_rows=16)
        gone = rng.sample(range(rows), rng.randrange(1, rows))
        order = kv.drop(gone)
        assert sorted(order) == sorted(set(range(rows)) - set(gone)), trial
        assert kv.lens == [lens[j] for j in order] and kv.width == max(kv.lens)
        for layer, k in zip(kv._glayers, keys, strict=True):
            want = k[order][:, :, width - kv.width :]
            assert torch.equal(layer.keys, want) and torch.equal(layer.values, want + 100)


def _poison_outside_windows(engine: LocalEngine) -> None:
    """NaN in every buffer cell of the running batch that is not a clean column of a row
    (padding the engine has not zeroed, spare rows and columns)."""
    kv = engine._kv
    assert kv is not None
    with torch.inference_mode():
        for layer in kv._glayers:
            for buf in (layer._kbuf, layer._vbuf):
                keep = buf[: kv.rows, :, layer._start : layer._end].clone()
                buf.fill_(float("nan"))
                for i, c in enumerate(kv.clean):
                    c = min(c, kv.width)
                    buf[i, :, layer._end - c : layer._end] = keep[i, :, kv.width - c :]


async def test_unzeroed_padding_is_never_read(model: torch.nn.Module) -> None:
    """Joiners' and widened rows' padding is not zeroed when they join (``BatchCache.clean``):
    with everything outside each row's clean columns NaN, short and long rows joining a
    running batch of mixed lengths (bucketed and full-width reads, rows moved into holes
    and re-sorted) still get every log-prob of a plain forward."""
    engine = LocalEngine(model, {EOS}, max_batch_size=64, context_length=512)
    rng = random.Random(5)
    loop = asyncio.get_running_loop()
    vocab = model.config.vocab_size

    def wave(tag: str, plens: list[int], ns: list[int]) -> list[Request]:
        reqs = []
        for i, (plen, n) in enumerate(zip(plens, ns, strict=True)):
            prompt = [1] + [rng.randrange(3, vocab) for _ in range(plen - 1)]
            sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
            reqs.append(Request(f"{tag}{i}", prompt, sp, loop, loop.create_future()))
        engine.submit_all(reqs)
        return reqs

    try:
        first = await pause_in_flight(
            engine, lambda: wave("a", [40, 6, 6, 3], [300, 120, 9, 60]), 3, "in_place"
        )
        _poison_outside_windows(engine)
        later = wave("b", [5] * 20 + [90], [rng.choice([2, 8, 30]) for _ in range(20)] + [20])
        engine.resume()
        await later[0].future  # a join, then more leaving and joining over poisoned buffers
        more = wave("c", [4, 120, 7], [50, 10, 40])
        done = await asyncio.gather(*(r.future for r in first + later + more))
    finally:
        engine.stop()
    assert engine.stats["bucketed_steps"] > 0
    for r in done:
        assert len(r.output_ids) == r.sampling.max_new_tokens
        with torch.no_grad():
            ids = torch.tensor([r.input_ids + r.output_ids])
            logits = model(ids).logits[0, len(r.input_ids) - 1 : -1].float()
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.output_ids)[:, None])
        torch.testing.assert_close(torch.tensor(r.logprobs), want.squeeze(-1), atol=1e-4, rtol=0)


def _prefilled(lens: list[int], heads: int = 2) -> DynamicCache:
    cache, width = DynamicCache(), max(lens)
    for layer in range(2):
        k = torch.randn(len(lens), heads, width, 4)
        cache.update(k, k + 100, layer)
    return cache


def test_decode_bias_kept_across_steps_is_the_one_built_anew() -> None:
    """The additive mask kept across decode steps (a view one column wider per step) equals
    the one its definition gives after every step, join, leave and sort — also past the
    buffer's spare columns."""
    rng = random.Random(1)
    lens = [rng.randrange(1, 9) for _ in range(5)]
    kv = BatchCache(_prefilled(lens), lens, max_rows=64)
    for trial in range(300):
        op = rng.random()
        if op < 0.05:
            new = [rng.randrange(1, 30) for _ in range(rng.randrange(1, 4))]
            kv.extend(_prefilled(new), new)
        elif op < 0.1 and kv.rows > 1:
            kv.drop(rng.sample(range(kv.rows), rng.randrange(1, kv.rows)))
        elif op < 0.12:
            kv.sort()
        got = kv.decode_bias(torch.device("cpu"), torch.float32)
        first = torch.tensor([kv.width - n for n in kv.lens])
        pad = torch.arange(kv.width + 1) < first[:, None]
        want = torch.zeros(pad.shape).masked_fill_(pad, -torch.inf)
        assert torch.equal(got, want), trial
        step = torch.randn(kv.rows, 2, 1, 4)
        for layer in kv.layers:
            layer.update(step, step)
        kv.advance()
