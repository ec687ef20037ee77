"""The embedded engine's LoRA serving in-process: several adapter versions in one running
batch equal PEFT's forward of each; the version ring pins, loads beside, unloads only when
unused, and never holds more than its capacity."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrl.engines.rollout.local.engine import LocalEngine, Request
from asyncrl.engines.rollout.local.lora import LoraSpec, UnknownAdapter
from asyncrl.engines.rollout.local.sampling import SamplingParams
from tests.marks import needs_peft

pytestmark = needs_peft  # (not importorskip: see tests/marks.py)

EOS = 2
TARGETS = ("q_proj", "v_proj", "down_proj")
RANK, ALPHA = 4, 8.0
PROMPTS = [[1, 3, 4, 5], [1, 6, 7, 8, 9, 10, 3], [1, 4], [1, 5, 5, 5, 5, 5, 5, 5, 5]]


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _peft_model(base: torch.nn.Module, seed: int) -> Any:
    """A PEFT LoRA model on a copy of ``base`` with random (non-zero) A and B."""
    import peft

    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS))
    model = peft.get_peft_model(copy.deepcopy(base), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def _adapter(model: Any) -> list[tuple[str, torch.Tensor]]:
    import peft

    return list(peft.get_peft_model_state_dict(model).items())


def _engine(base: torch.nn.Module, capacity: int, **kw: Any) -> LocalEngine:
    eng = LocalEngine(copy.deepcopy(base), {EOS}, max_batch_size=8, **kw)
    eng.enable_lora(LoraSpec(RANK, ALPHA, TARGETS, capacity))
    return eng


@pytest.fixture
def engine(base: torch.nn.Module) -> Iterator[LocalEngine]:
    eng = _engine(base, 3, context_length=100_000)
    try:
        yield eng
    finally:
        eng.stop()


def _request(ids: list[int], rid: str, **sp: Any) -> Request:
    loop = asyncio.get_running_loop()
    return Request(rid, ids, SamplingParams(**sp), loop, loop.create_future())


def test_per_row_versions_in_one_batch_equal_peft_forward(base: torch.nn.Module) -> None:
    models = [_peft_model(base, s) for s in (1, 2)]
    eng = _engine(base, 3)
    try:
        for v, m in enumerate(models, start=1):
            eng.load_adapter(str(v), _adapter(m), timeout_s=5)
        ring = eng.lora
        assert ring is not None
        slots = [ring.pin_named(f"policy-v{v}")[1] for v in (1, 2, 0, 2)]
        ids = torch.tensor([[1, 3, 4, 5, 6], [1, 6, 7, 8, 9], [1, 4, 4, 4, 3], [1, 9, 8, 7, 6]])
        with torch.no_grad():
            ring.set_rows(slots)  # rows on versions 1, 2, 0 (the base) and 2 in one forward
            got = eng.model(input_ids=ids).logits
            refs = [models[0], models[1], base, models[1]]
            for i, ref in enumerate(refs):
                want = ref(input_ids=ids[i : i + 1]).logits[0]
                torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)
            ring.set_rows([slots[0]] * 4)  # one version for every row: PEFT's own matmuls
            torch.testing.assert_close(
                eng.model(input_ids=ids).logits, models[0](input_ids=ids).logits, atol=0, rtol=0
            )
    finally:
        eng.stop()


async def test_generation_on_mixed_versions_matches_peft_greedy(
    engine: LocalEngine, base: torch.nn.Module
) -> None:
    models = [_peft_model(base, s) for s in (3, 4)]
    await asyncio.to_thread(engine.load_adapter, "1", _adapter(models[0]), 5)
    first = [
        _request(p, f"a{i}", max_new_tokens=8, temperature=0, ignore_eos=True)
        for i, p in enumerate(PROMPTS)
    ]
    engine.submit_all(first)  # pinned to v1 when they join
    await asyncio.to_thread(engine.load_adapter, "2", _adapter(models[1]), 5)
    second = [
        _request(p, f"b{i}", max_new_tokens=8, temperature=0, ignore_eos=True)
        for i, p in enumerate(PROMPTS)
    ]
    engine.submit_all(second)
    done = await asyncio.wait_for(asyncio.gather(*(r.future for r in first + second)), 60)
    for r in done:
        m = models[0] if r.min_version == "1" else models[1]
        assert r.min_version in ("1", "2")
        want = m.generate(
            torch.tensor([r.input_ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )[0, len(r.input_ids) :].tolist()  # fmt: skip
        assert r.output_ids == want, r.rid
    assert {r.min_version for r in done[len(first) :]} == {"2"}


async def test_ring_pins_a_long_request_while_newer_versions_load(
    engine: LocalEngine, base: torch.nn.Module
) -> None:
    """A request admitted under v1 produces all its tokens under v1 while v2 and v3 load; the
    ring (capacity 3) never unloads v1 while it runs and never holds more than 3 versions: v4
    waits for v1 to be unused."""
    ring = engine.lora
    assert ring is not None
    models = {v: _peft_model(base, 10 + v) for v in range(1, 5)}
    adapters = {v: _adapter(m) for v, m in models.items()}
    await asyncio.to_thread(engine.load_adapter, "1", adapters[1], 5)
    long = _request([1, 3, 4], "long", max_new_tokens=100_000, ignore_eos=True)
    engine.submit(long)
    await _until(lambda: len(long.output_ids) > 5)
    for v in (2, 3):  # load beside v1 without a pause: the long request keeps generating
        n = len(long.output_ids)
        await asyncio.to_thread(engine.load_adapter, str(v), adapters[v], 5)
        await _until(lambda n=n: len(long.output_ids) > n + 5)
    assert ring.held() == ["1", "2", "3"] and ring.info()["versions"]["policy-v1"] == 1
    short = _request([1, 5], "short", max_new_tokens=4)
    engine.submit(short)
    assert (await asyncio.wait_for(short.future, 30)).min_version == "3"  # the newest
    slot2 = ring.pin_named("policy-v2")[1]  # a request on v2 as well: v1, v2 in use
    with pytest.raises(TimeoutError, match="no free slot"):
        await asyncio.to_thread(engine.load_adapter, "4", adapters[4], 0.3)
    assert ring.held() == ["1", "2", "3"]
    load4 = asyncio.ensure_future(asyncio.to_thread(engine.load_adapter, "4", adapters[4], 30))
    n = len(long.output_ids)
    await _until(lambda: len(long.output_ids) > n + 5)
    assert not load4.done() and ring.held() == ["1", "2", "3"]  # waits; v1 still served
    ring.unpin(slot2)  # v2's request ends: v4 takes its slot, v1 (in use) stays
    await asyncio.wait_for(load4, 30)
    assert ring.held() == ["1", "3", "4"] and not long.future.done()
    engine.abort("long")  # the test's end of the long request (no update aborts anything)
    await asyncio.to_thread(engine.load_adapter, "5", adapters[4], 5)
    assert ring.held() == ["3", "4", "5"]
    assert long.min_version == "1" and len(long.output_ids) > 20
    with torch.no_grad():  # every token of it came from v1: PEFT's v1 gives its log-probs
        ids = torch.tensor([long.input_ids + long.output_ids])
        logp = torch.log_softmax(models[1](input_ids=ids).logits[0, 2:-1], -1)
        want = logp.gather(-1, ids[0, 3:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(long.logprobs), want, atol=1e-4, rtol=0)
    assert engine.stats["pauses"] == 0 and engine.stats["aborted"] == 0
    with pytest.raises(UnknownAdapter, match=r"policy-v3, policy-v4, policy-v5"):
        ring.pin_named("policy-v1")


async def test_an_adapter_that_does_not_fit_is_refused_before_loading(
    engine: LocalEngine, base: torch.nn.Module
) -> None:
    ring = engine.lora
    assert ring is not None
    good = _adapter(_peft_model(base, 5))
    before = ring.factors("0")
    wrong_shape = [(n, t[:, :-1] if "lora_A" in n else t) for n, t in good]
    with pytest.raises(ValueError, match=r"shape \(4, 63\) != \(4, 64\)"):
        engine.load_adapter("1", wrong_shape, 1)
    with pytest.raises(ValueError, match="incomplete"):
        engine.load_adapter("1", good[:-1], 1)
    with pytest.raises(ValueError, match="no LoRA factor"):
        engine.load_adapter("1", [*good, ("base_model.model.lm_head.lora_A.weight", good[0][1])], 1)
    assert ring.held() == ["0"] and engine.weight_version == "0" and ring.loads == 0
    for n, t in ring.factors("0").items():
        assert torch.equal(t, before[n])
    info = ring.info()
    per_version = sum(t.numel() * t.element_size() for _, t in good)
    assert info["bytes"] == 3 * per_version and info["capacity"] == 3


async def test_an_adapter_handed_over_loads_beside_the_served_ones(
    engine: LocalEngine, base: torch.nn.Module
) -> None:
    """What a CUDA IPC adapter push does once it copied the trainer's tensors (the copy needs
    a GPU: tests/transports/weights/test_cuda_ipc_lora.py): ``WeightReceiver.commit`` with
    them loads the version into the ring as a staged collective push does; a misfit one is
    refused and nothing loads."""
    from asyncrl.engines.rollout.local.weights import WeightReceiver

    ring = engine.lora
    assert ring is not None
    recv = WeightReceiver(engine)
    try:
        good = _adapter(_peft_model(base, 7))
        out = await recv.commit({"new_version": "1"}, good)
        assert out["success"], out
        assert ring.held() == ["0", "1"] and engine.weight_version == "1"
        held = ring.factors("1")
        assert all(torch.equal(held[n], t) for n, t in good)
        bad = [(n, t[:, :-1] if "lora_A" in n else t) for n, t in good]
        out = await recv.commit({"new_version": "2"}, bad)
        assert not out["success"] and "shape (4, 63) != (4, 64)" in out["message"], out
        assert ring.held() == ["0", "1"] and engine.weight_version == "1"
    finally:
        recv.close()


async def _until(cond: Any, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.mark.gpu
def test_per_row_versions_on_cuda_equal_peft_forward(base: torch.nn.Module) -> None:
    """The per-row LoRA path on CUDA (float32, TF32 off): rows on versions 1, 2, 0 and 2 in
    one forward equal PEFT's forward of each adapter on the same device; then a short
    generation mixing both versions runs on the GPU."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    models = [_peft_model(base, s).cuda() for s in (5, 6)]
    eng = LocalEngine(copy.deepcopy(base), {EOS}, max_batch_size=8, device="cuda")
    eng.enable_lora(LoraSpec(RANK, ALPHA, TARGETS, 3))
    try:
        for v, m in enumerate(models, start=1):
            eng.load_adapter(str(v), [(n, t.cpu()) for n, t in _adapter(m)], timeout_s=5)
        ring = eng.lora
        assert ring is not None and next(iter(ring.layers.values())).A.is_cuda
        slots = [ring.pin_named(f"policy-v{v}")[1] for v in (1, 2, 0, 2)]
        ids = torch.tensor([[1, 3, 4, 5, 6], [1, 6, 7, 8, 9], [1, 4, 4, 4, 3], [1, 9, 8, 7, 6]])
        ids = ids.cuda()
        cuda_base = copy.deepcopy(base).cuda()
        with torch.no_grad():
            ring.set_rows(slots)
            got = eng.model(input_ids=ids).logits
            for i, ref in enumerate([models[0], models[1], cuda_base, models[1]]):
                want = ref(input_ids=ids[i : i + 1]).logits[0]
                torch.testing.assert_close(got[i], want, atol=1e-4, rtol=1e-4)
        for s in slots:
            ring.unpin(s)

        async def generate() -> list[Request]:
            reqs = [
                _request(p, f"g{i}", max_new_tokens=8, temperature=0, ignore_eos=True)
                for i, p in enumerate(PROMPTS)
            ]
            eng.submit_all(reqs)
            return list(await asyncio.wait_for(asyncio.gather(*(r.future for r in reqs)), 30))

        done = asyncio.run(generate())
        assert all(len(r.output_ids) == 8 and r.min_version == "2" for r in done)
    finally:
        eng.stop()
        torch.backends.cuda.matmul.allow_tf32 = tf32
