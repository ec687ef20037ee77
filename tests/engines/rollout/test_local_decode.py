"""The embedded engine's lean decode step (``local.decode``) against the model's own forward:
the same tokens and log-probs for Llama, Mistral, Qwen2 and Qwen3 shapes (GQA, biases, per-head
norms), bucketed attention, rows joining and leaving, and weights loaded between steps; models
it does not reproduce get the model's forward."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch

from asyncrl.engines.rollout.local.decode import LeanDecoder
from asyncrl.engines.rollout.local.engine import LocalEngine, Request
from asyncrl.engines.rollout.local.kv import BatchCache
from asyncrl.engines.rollout.local.lora import LoraSpec
from asyncrl.engines.rollout.local.sampling import SamplingParams

VOCAB = 24
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def _model(kind: str, dtype: torch.dtype = torch.float32, **extra: Any) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = {
        "llama": (transformers.LlamaConfig, dict(attention_bias=True, mlp_bias=True)),
        "mistral": (transformers.MistralConfig, dict(sliding_window=None)),
        "qwen2": (transformers.Qwen2Config, {}),
        "qwen3": (transformers.Qwen3Config, dict(head_dim=16)),
    }[kind]
    config = cfg[0](**{**SHAPE, **cfg[1], **extra}, attn_implementation="sdpa")
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():  # biases and norms away from their zero/one init: each one counts
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


async def _run(engine: LocalEngine, seed: int, temperature: float = 0.0) -> list[Request]:
    """Waves of requests of mixed prompt and answer lengths, many rows at
    once (bucketed attention), later ones joining a running batch that others leave."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    reqs = []
    for i in range(40):
        prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(rng.choice([2, 5, 30, 90]))]
        sp = SamplingParams(
            max_new_tokens=rng.choice([1, 3, 20, 120]), ignore_eos=True, temperature=temperature
        )
        reqs.append(Request(str(i), prompt, sp, loop, loop.create_future()))
    for i in range(0, len(reqs), 20):
        engine.submit_all(reqs[i : i + 20])
        await reqs[i].future  # the next wave joins while most of this one still decodes
    await asyncio.gather(*(r.future for r in reqs))
    return reqs


def _engines(model: torch.nn.Module, **kw: Any) -> tuple[LocalEngine, LocalEngine]:
    lean = LocalEngine(model, {2}, max_batch_size=32, context_length=512, seed=3, **kw)
    stock = LocalEngine(
        model, {2}, max_batch_size=32, context_length=512, seed=3, lean_decode=False, **kw
    )
    assert lean._lean is not None and stock._lean is None
    return lean, stock


def _same(a: list[Request], b: list[Request], atol: float = 1e-5) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids and x.finish == y.finish
        torch.testing.assert_close(
            torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=atol, rtol=0
        )


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
async def test_lean_decode_gives_the_models_own_tokens_and_logprobs(kind: str) -> None:
    model = _model(kind)
    lean, stock = _engines(model)
    try:
        a, b = await _run(lean, 0), await _run(stock, 0)
        assert lean.stats["bucketed_steps"] > 0 and lean.stats["prefill_steps"] >= 2
        _same(a, b)
        for prompt_len, r in ((len(r.input_ids), r) for r in a[:8]):  # and a plain forward's
            with torch.inference_mode():
                logits = model(torch.tensor([r.input_ids + r.output_ids])).logits[0].float()
            want = torch.log_softmax(logits[prompt_len - 1 : -1], -1)
            got = want.gather(-1, torch.tensor(r.output_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(r.logprobs), got, atol=1e-4, rtol=0)
    finally:
        lean.stop()
        stock.stop()


async def test_lean_decode_samples_as_the_stock_forward_and_sees_loaded_weights() -> None:
    """Sampled (temperature 1, one seed): the same tokens; then weights loaded in place and
    by zero-copy between runs are what the next decode steps use."""
    model = _model("qwen2")
    lean, stock = _engines(model, kv_after_update="keep")
    try:
        _same(await _run(lean, 1, temperature=1.0), await _run(stock, 1, temperature=1.0))
        other = _model("qwen2")
        with torch.no_grad():
            for p in other.parameters():
                p.mul_(1.5)
        named = list(other.named_parameters())
        for zero_copy in (False, True):
            for eng in (lean, stock):
                eng.load_weights([(n, t.detach().clone()) for n, t in named], None, zero_copy)
            _same(await _run(lean, 2), await _run(stock, 2))
        before = await _run(lean, 2)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        after = await _run(lean, 2)
        assert [r.logprobs for r in before] != [r.logprobs for r in after]
    finally:
        lean.stop()
        stock.stop()


def test_one_bfloat16_decode_step_matches_the_models_forward() -> None:
    model = _model("qwen3", torch.bfloat16)
    decoder = LeanDecoder.build(model)
    assert decoder is not None
    ids = torch.tensor([[1, 5, 7, 9, 11], [0, 0, 1, 4, 6]])
    mask = (ids != 0).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = []
    for lean in (True, False):
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
            kv = BatchCache(out.past_key_values, [5, 3], 8, 64)
            step = torch.tensor([3, 8])
            if lean:
                bias = kv.decode_bias(torch.device("cpu"), torch.bfloat16)
                logits.append(decoder(step, torch.tensor(kv.lens), 5, bias, kv.layers, None))
            else:
                full = kv.decode_mask(torch.device("cpu"))
                o = model(
                    input_ids=step[:, None],
                    attention_mask=full,
                    position_ids=kv.positions(torch.device("cpu")),
                    past_key_values=kv.cache,
                )
                logits.append(o.logits[:, -1])
    assert logits[0].dtype == torch.bfloat16
    torch.testing.assert_close(logits[0].float(), logits[1].float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(
    "kind, extra",
    [
        ("mistral", dict(sliding_window=16)),
        ("qwen2", dict(hidden_act="gelu")),
        ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})),
        ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0)),
    ],
)
def test_models_it_does_not_reproduce_keep_their_forward(kind: str, extra: dict[str, Any]) -> None:
    model = _model(kind, **extra)
    assert LeanDecoder.build(model) is None
    eng = LocalEngine(model, {2})
    try:
        assert eng._lean is None
    finally:
        eng.stop()


def test_lora_serving_decodes_through_the_model() -> None:
    """Adapters wrap the linear layers: the lean step would skip them."""
    eng = LocalEngine(_model("qwen2"), {2})
    try:
        assert eng._lean is not None
        eng.enable_lora(LoraSpec(4, 8.0, ("q_proj", "v_proj"), 2))
        assert eng._lean is None
        assert LeanDecoder.build(eng.model) is None
    finally:
        eng.stop()
