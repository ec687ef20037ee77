"""LoRA on the train engine (PEFT): only the adapter trains, checkpoints hold adapter +
optimizer and resume exactly, the export loads with PEFT (and merged, with transformers) and
gives the trained policy's greedy outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.engines.train.fsdp import FSDPEngine
from tests.engines.train._ranks import TokenMeanLoss, assert_resumes_exactly, make_batch
from tests.marks import needs_peft

pytestmark = needs_peft  # (not importorskip: see tests/marks.py)

LORA = ["--lora.rank=4", "--lora.alpha=8", "--lora.target_modules=q_proj,v_proj,up_proj"]


def _engine(model: Path, *extra: str) -> FSDPEngine:
    torch.set_num_threads(1)
    cfg = load_config(None, ["--trainer.micro_batch_tokens=24", "--lora.lr=0.05", *LORA, *extra])
    return FSDPEngine(str(model), cfg)


def _greedy(model: torch.nn.Module, prompt: list[int], n: int = 6) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], 1)
    return ids[0, len(prompt) :].tolist()


def test_only_the_adapter_trains_and_is_what_named_weights_yields(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters() if "lora" not in n}
    adapter0 = dict(engine.named_weights())
    assert adapter0 and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in adapter0)
    assert len(adapter0) == 2 * 3 * 2  # 2 factors x 3 target modules x 2 layers
    for _ in range(3):
        assert engine.train_batch(make_batch(1), TokenMeanLoss())["skipped"] == 0.0
    for n, p in engine.model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), f"{n} (frozen) changed"
    b = next(t for n, t in engine.named_weights() if n.endswith("lora_B.weight"))
    assert b.abs().max() > 0  # B starts at 0 and moved


def test_lora_resume_continues_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = _engine(tiny_model_dir)
    batch, batch2 = make_batch(1), make_batch(2)
    engine.train_batch(batch, TokenMeanLoss())
    assert_resumes_exactly(engine, lambda: _engine(tiny_model_dir), tmp_path / "ckpt", batch2)
    # the checkpoint holds the adapter (and its optimizer state), not the frozen base
    meta = (tmp_path / "ckpt" / ".metadata").read_bytes()
    assert b"lora_A" in meta and b"embed_tokens" not in meta
    full = FSDPEngine(str(tiny_model_dir), load_config(None, []))
    with pytest.raises(ValueError, match="LoRA-adapter checkpoint"):
        full.load(str(tmp_path / "ckpt"))


def test_export_loads_with_peft_and_merged_with_the_same_greedy_outputs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine = _engine(tiny_model_dir, "--lora.export_merged=true")
    for seed in range(4):
        engine.train_batch(make_batch(seed), TokenMeanLoss())
    engine.model.eval()
    prompts = [[1, 5, 7, 2], [1, 3, 3, 9, 2], [1, 12, 4, 2]]
    want = [_greedy(engine.model, p) for p in prompts]
    base_out = [
        _greedy(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), p) for p in prompts
    ]
    assert want != base_out, "the adapter must change the policy for this test to mean anything"
    out = tmp_path / "final"
    engine.export_hf(str(out))
    assert (out / "adapter" / "adapter_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft_model = PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    assert [_greedy(peft_model, p) for p in prompts] == want
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert [_greedy(merged, p) for p in prompts] == want
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        ref = engine.model(input_ids=ids).logits
        torch.testing.assert_close(peft_model(input_ids=ids).logits, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, ref, atol=1e-4, rtol=1e-4)
