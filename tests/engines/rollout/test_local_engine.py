"""The embedded engine in-process: KV-cached continuous batching, sampling, abort, pause."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from asyncrl.engines.rollout.local.engine import LocalEngine, Request
from asyncrl.engines.rollout.local.sampling import SamplingParams, sample

EOS = 2
PROMPTS = [[1, 3, 4, 5], [1, 6, 7, 8, 9, 10, 3], [1, 4], [1, 5, 5, 5, 5, 5, 5, 5, 5], [1, 3, 9]]


@pytest.fixture
def engine(model: torch.nn.Module) -> Iterator[LocalEngine]:
    eng = LocalEngine(model, {EOS}, max_batch_size=3)
    try:
        yield eng
    finally:
        eng.stop()


async def _gen(engine: LocalEngine, ids: list[int], rid: str = "", **sp: Any) -> Request:
    loop = asyncio.get_running_loop()
    req = Request(rid or str(id(ids)), ids, SamplingParams(**sp), loop, loop.create_future())
    engine.submit(req)
    return await req.future


def _recompute(model: torch.nn.Module, prompt: list[int], out: list[int]) -> torch.Tensor:
    """Log-probs of ``out`` after ``prompt`` from one plain full forward (no cache, no padding)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None]).squeeze(-1)


async def test_greedy_matches_hf_generate_under_continuous_batching(
    engine: LocalEngine, model: torch.nn.Module
) -> None:
    lengths = [4, 12, 7, 20, 3]  # more requests than max_batch_size: later ones join mid-run
    reqs = await asyncio.gather(
        *(
            _gen(engine, p, rid=str(i), max_new_tokens=n, temperature=0, ignore_eos=True)
            for i, (p, n) in enumerate(zip(PROMPTS, lengths, strict=True))
        )
    )
    assert engine.stats["prefill_steps"] >= 2  # requests joined a running batch
    for p, n, r in zip(PROMPTS, lengths, reqs, strict=True):
        ref = model.generate(
            torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert r.output_ids == ref[0, len(p) :].tolist()
        assert r.finish == {"type": "length", "length": n}
        torch.testing.assert_close(
            torch.tensor(r.logprobs), _recompute(model, p, r.output_ids), atol=1e-4, rtol=0
        )


async def test_sampled_logprobs_match_recompute_and_stop_ids(
    engine: LocalEngine, model: torch.nn.Module
) -> None:
    reqs = await asyncio.gather(
        *(_gen(engine, p, rid=f"s{i}", max_new_tokens=16) for i, p in enumerate(PROMPTS))
    )
    for p, r in zip(PROMPTS, reqs, strict=True):
        torch.testing.assert_close(
            torch.tensor(r.logprobs), _recompute(model, p, r.output_ids), atol=1e-4, rtol=0
        )
        if r.finish["type"] == "stop":
            assert r.output_ids[-1] == EOS and EOS not in r.output_ids[:-1]
        else:
            assert len(r.output_ids) == 16
    greedy = await _gen(engine, PROMPTS[0], max_new_tokens=16, temperature=0, ignore_eos=True)
    stop = greedy.output_ids[3]
    cut = greedy.output_ids.index(stop) + 1
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    again = await _gen(engine, PROMPTS[0], stop_token_ids=(stop,), **sp)
    assert again.output_ids == greedy.output_ids[:cut]
    assert again.finish == {"type": "stop", "matched": stop}


def test_sampling_respects_top_k_top_p_and_greedy() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(400, 1)
    top2 = SamplingParams(top_k=2)
    toks, lps = sample(logits, [top2] * 400, gen)
    assert set(toks.tolist()) == {0, 1}
    torch.testing.assert_close(lps, torch.log_softmax(logits, -1).gather(-1, toks[:, None])[:, 0])
    nucleus = SamplingParams(top_p=0.5)  # p(0) = 0.64 > 0.5: only token 0 survives
    assert set(sample(logits, [nucleus] * 400, gen)[0].tolist()) == {0}
    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=2.0, top_k=3)] * 200
    toks, _ = sample(logits, mixed, gen)
    assert set(toks[0::2].tolist()) == {0} and set(toks[1::2].tolist()) == {0, 1, 2}
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_dict({"top_p": 0})
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"temprature": 1.0})
    with pytest.raises(ValueError, match="not supported"):
        SamplingParams.from_dict({"repetition_penalty": 1.2})
    everything = SamplingParams.from_dict({"top_k": 1 << 30, "skip_special_tokens": True})
    assert everything.top_k == 1 << 30


PROGRESS_S = 120.0  # longest wait for the scheduler to do something, however loaded the machine


async def _wait_tokens(engine: LocalEngine, req_list: list[Request], n: int) -> None:
    deadline = asyncio.get_running_loop().time() + PROGRESS_S
    while not all(len(r.output_ids) >= n for r in req_list):
        assert asyncio.get_running_loop().time() < deadline, f"no {n} tokens in {PROGRESS_S:g} s"
        await asyncio.sleep(0.005)


async def _parked(engine: LocalEngine) -> None:
    """Until the scheduler thread waits on its condition: with requests queued or running it
    does so only while paused (``LocalEngine._run``), so once it does, no step runs until a
    resume: the proof that a pause holds, without watching a quiet window."""
    deadline = asyncio.get_running_loop().time() + PROGRESS_S
    while not engine._cv._waiters:  # type: ignore[attr-defined]  # threading.Condition's own
        assert asyncio.get_running_loop().time() < deadline, "the scheduler never parked"
        await asyncio.sleep(0.001)


def _submit(engine: LocalEngine, rid: str, n: int = 100_000) -> Request:
    loop = asyncio.get_running_loop()
    sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
    req = Request(rid, [1, 3, 4], sp, loop, loop.create_future())
    engine.submit(req)
    return req


async def test_abort_one_and_all_return_partial_output(engine: LocalEngine) -> None:
    a, b, c = (_submit(engine, rid) for rid in "abc")
    await _wait_tokens(engine, [a, b], 3)
    assert engine.abort("a") == 1
    done = await a.future
    assert done.finish["type"] == "abort" and 3 <= len(done.output_ids) < 100_000
    assert len(done.logprobs) == len(done.output_ids)
    frozen = list(done.output_ids)
    assert engine.abort(abort_all=True) == 2
    for r in await asyncio.gather(b.future, c.future):
        assert r.finish["type"] == "abort" and len(r.output_ids) < 100_000
    assert a.output_ids == frozen and engine.num_requests == 0


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_keeps_requests_and_continue_resumes_them(
    engine: LocalEngine, mode: str
) -> None:
    n = 100_000  # cannot finish during the test: the pause always lands mid-request
    reqs = [_submit(engine, f"{mode}{i}", n=n) for i in range(4)]  # 4 > max_batch_size
    await _wait_tokens(engine, reqs[:3], 2)
    engine.pause(mode)
    counts = [len(r.output_ids) for r in reqs]
    await _parked(engine)  # every request still queued or running: parked means paused
    later = _submit(engine, f"{mode}-later", n=5)  # wakes the scheduler, which parks again
    await _parked(engine)
    assert [len(r.output_ids) for r in reqs] == counts and not any(r.future.done() for r in reqs)
    assert later.output_ids == [] and engine.num_requests == 5
    engine.resume()
    await _wait_tokens(engine, reqs[:3], max(counts) + 2)  # held requests go on decoding
    engine.abort(abort_all=True)
    for r, before in zip(await asyncio.gather(*(r.future for r in reqs)), counts, strict=True):
        assert r.finish["type"] == "abort" and before <= len(r.output_ids) < n
        assert len(r.logprobs) == len(r.output_ids)
    assert (await later.future).finish is not None  # answered (finished or aborted)


async def test_pause_abort_returns_everything_and_new_requests_wait(engine: LocalEngine) -> None:
    reqs = [_submit(engine, f"x{i}") for i in range(4)]
    await _wait_tokens(engine, reqs[:3], 1)
    engine.pause("abort")
    assert all(r.finish is not None and r.finish["type"] == "abort" for r in reqs)
    await asyncio.gather(*(r.future for r in reqs))
    later = _submit(engine, "later", n=5)
    await _parked(engine)  # woken by the submit; parks again with "later" queued: paused
    assert later.output_ids == [] and engine.num_requests == 1
    engine.resume()
    assert (await later.future).finish["type"] == "length"
    with pytest.raises(ValueError, match="pause mode"):
        engine.pause("sideways")


async def test_weight_load_mid_flight_recomputes_cache_and_keeps_oldest_version(
    engine: LocalEngine, model: torch.nn.Module
) -> None:
    prompt = [1, 3, 4]  # _submit's prompt
    req = _submit(engine, "w", n=300)
    await _wait_tokens(engine, [req], 5)
    engine.pause("in_place")
    before = len(req.output_ids)
    new = [(n, p.detach() * 1.01) for n, p in model.named_parameters()]
    old = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    try:
        engine.load_weights(new, "7")
        engine.resume()
        done = await req.future
        assert engine.weight_version == "7" and done.min_version == "0"
        # tokens after the update are scored by the new weights over the whole prefix
        want = _recompute(model, prompt, done.output_ids)[before:]
        torch.testing.assert_close(torch.tensor(done.logprobs[before:]), want, atol=1e-4, rtol=0)
        fresh = await _gen(engine, prompt, max_new_tokens=2)
        assert fresh.min_version == "7"
    finally:
        engine.load_weights(old, "0")
    with pytest.raises(KeyError):
        engine.load_weights([("nope", torch.zeros(1))], "8")
    assert engine.weight_version == "0"


@pytest.mark.gpu
async def test_cuda_engine_matches_hf_generate(model: torch.nn.Module) -> None:
    cuda_model = type(model)(model.config).to("cuda").eval()
    cuda_model.load_state_dict(model.state_dict())
    eng = LocalEngine(cuda_model, {EOS}, device="cuda", max_batch_size=2)
    try:
        reqs = await asyncio.gather(
            *(
                _gen(eng, p, rid=str(i), max_new_tokens=8, temperature=0, ignore_eos=True)
                for i, p in enumerate(PROMPTS)
            )
        )
        for p, r in zip(PROMPTS, reqs, strict=True):
            ref = cuda_model.generate(
                torch.tensor([p], device="cuda"),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            assert r.output_ids == ref[0, len(p) :].tolist()
        sampled = await _gen(eng, PROMPTS[0], max_new_tokens=8, top_p=0.9, top_k=5)
        assert len(sampled.output_ids) >= 1
    finally:
        eng.stop()
