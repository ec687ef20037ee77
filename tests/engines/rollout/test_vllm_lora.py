"""LoRA adapter versions on vLLM 0.33 as it behaves: asyncrl's adapter sender, client and a
whole ``asyncrl run --lora.rank=8 --rollout.backend=vllm`` against the stand-in's LoRA serving
(``vllm/lora.py``, every behaviour cited from vLLM's source).

vLLM differs from SGLang where it matters to the ring: its unload forgets the name at once
and does not wait (a request running on the version keeps it), and a name it does not know
is refused (404), never reloaded; so the sender keeps an unloaded version's folder a while.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncrl.config import LoraConfig
from asyncrl.engines.rollout.base import EngineBadRequest
from asyncrl.engines.rollout.factory import weight_family
from asyncrl.engines.rollout.vllm.client import VLLMClient
from asyncrl.engines.rollout.vllm.launcher import VLLM_LORA_ENV, vllm_lora_args
from asyncrl.transports.weights.adapter_send import AdapterFolderSender, AdapterSpec
from tests.engines.rollout._background import generate_in_background
from tests.engines.rollout.test_sglang_lora import (
    LOAD_ORDER,
    RANK,
    TARGETS,
    _adapters,
    _first_token,
    _peft_logprobs,
    _sha,
    check_adapters_named,
    run_lora_job,
)
from tests.engines.rollout.vllm.server import start_vllm
from tests.marks import needs_peft

pytestmark = needs_peft  # (not importorskip: see tests/marks.py)


def _flags(lc: LoraConfig, targets: tuple[str, ...]) -> tuple[str, ...]:
    """asyncrl's vLLM LoRA flags, and the target layers the stand-in hooks (vLLM takes them
    from each adapter's config)."""
    return (*vllm_lora_args(lc, 2), "--lora-target-modules", *targets)


def test_adapter_ring_on_vllm(tmp_path: Path, tiny_model_dir: Path) -> None:
    flags = _flags(LoraConfig(rank=RANK, target_modules=TARGETS), TARGETS)
    server = start_vllm(
        tiny_model_dir, tmp_path / "vl", step_s=0.03, flags=flags, env=VLLM_LORA_ENV
    )
    family = weight_family("vllm")
    assert family.adapters is not None and family.adapter_folders_kept
    spec = AdapterSpec("policy", RANK, 16.0, 0.0, 2, str(tmp_path / "adapters"), "base")
    sender = AdapterFolderSender([server.url], spec, family.adapters, 60, keep_folders=True)
    versions, wrapped = _adapters(tiny_model_dir, 3)
    try:
        sender.push(versions[0].items(), 1).wait(60)
        sp = {"max_new_tokens": 30, "ignore_eos": True, "lora_path": "policy-v1"}
        t, _ = generate_in_background(
            lambda: VLLMClient(server.url),
            [("long", [1, 3, 4], sp)],
            lambda: len(server.state()["reqs"].get("long", {}).get("adapters", [])) >= 3,
            "vLLM stand-in: request 'long' started",
        )
        sender.push(versions[1].items(), 2).wait(60)
        sender.push(versions[2].items(), 3).wait(60)  # vLLM's unload of v1 does not wait
        assert len(server.state()["reqs"]["long"]["adapters"]) < 30, "the push waited"
        t.join(60)
        st = server.state()
        assert st["reqs"]["long"]["adapters"] == ["policy-v1"] * 30  # kept its adapter
        lora = st["lora"]
        assert lora["held"] == ["policy-v2", "policy-v3"] and lora["most_held"] == 2
        assert [next(iter(e.items())) for e in lora["events"]] == [
            ("load", "policy-v1"),
            ("load", "policy-v2"),
            ("unload", "policy-v1"),
            ("load", "policy-v3"),
        ]
        for v, tensors in enumerate(versions, start=1):
            assert lora["sha256"][f"policy-v{v}"] == _sha(tensors)
        assert (tmp_path / "adapters" / "policy-v1").is_dir()  # kept: see the module doc
        ref = _peft_logprobs(wrapped, versions[2], [1, 3, 4])
        tok, lp = asyncio.run(_first_token(server.url, "policy-v3", VLLMClient))
        assert abs(lp - float(ref[tok])) < 1e-4
        with pytest.raises(EngineBadRequest, match="policy-v1` does not exist"):
            asyncio.run(_first_token(server.url, "policy-v1", VLLMClient))
        assert not any(c["path"] == "/pause" for c in server.wire())
    finally:
        sender.close()
        server.stop()


@pytest.mark.slow
def test_lora_run_against_vllm(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``asyncrl run --lora.rank=8 --rollout.backend=vllm``: one load per step in order, the
    oldest unloaded first, no pause, the requests name their versions, and the last
    version held bit for bit as the trainer's final adapter."""
    lc = LoraConfig(rank=8)
    flags = _flags(lc, lc.target_modules)
    server = start_vllm(
        tiny_model_dir, tmp_path / "vl", step_s=0.005, flags=flags, env=VLLM_LORA_ENV
    )
    try:
        run_lora_job("vllm", server.url, tiny_model_dir, tmp_path / "run", server.log)
        wire = [c for c in server.wire() if c["method"] == "POST"]
        paths = {c["path"] for c in wire}
        assert paths <= {
            "/inference/v1/generate",
            "/v1/load_lora_adapter",
            "/v1/unload_lora_adapter",
        }
        assert all(c["status"] == 200 for c in wire), [c for c in wire if c["status"] != 200]
        lora = server.state()["lora"]
        assert [next(iter(e.items())) for e in lora["events"]] == LOAD_ORDER
        named = [c["body"]["model"] for c in wire if c["path"] == "/inference/v1/generate"]
        check_adapters_named(named, lora["sha256"], tmp_path / "run")
    finally:
        server.stop()
