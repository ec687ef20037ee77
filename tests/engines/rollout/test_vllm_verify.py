"""``weights.verify`` on the vLLM family: vLLM 0.33's ``/weight_checker`` after each push.

The other side is vLLM's own ``/weight_checker`` route (``vllm/app.py``) over the
stand-in's workers (``vllm/standin.py``): it answers as vLLM's route does (rl:232-266:
``{"checksums": {"dp0:pp0:pcp0:tp{i}:NAME": sha256}}``, every worker's every parameter,
model_loader/weight_checksum.py:32-38), computed by each receiving rank from the tensors
it loaded. ``--corrupt-calls`` loads one element wrong on the last TP rank while
answering 200: a silent fault that only a check finds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.engines.rollout.vllm.server import VLLMStandIn, start_vllm


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


@pytest.fixture(scope="module")
def corrupting(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[VLLMStandIn]:
    """One TP-2 stand-in whose update calls 1 and 4 load a wrong element on rank 1."""
    server = start_vllm(tiny_model_dir, tmp_path_factory.mktemp("vllm"), 2, corrupt_calls="1,4")
    yield server
    server.stop()


def _checker_calls(server: VLLMStandIn) -> list[dict[str, object]]:
    return [c for c in server.wire() if c["path"] == "/weight_checker"]


def test_sampled_verify_finds_a_silent_fault_and_repushes(
    corrupting: VLLMStandIn, tiny_model_dir: Path
) -> None:
    """``verify=sampled``: the first push's silent fault on rank 1 is found through
    ``/weight_checker`` and the push re-sent as a new round (bit-exact after); the next push
    compares a sample of the comparable tensors. The same fault under ``verify=off`` stays:
    the check, nothing else, caught it."""
    from safetensors.torch import load_file

    from asyncrl.config import GlooWeightsConfig
    from asyncrl.transports.weights import make_weight_transport
    from asyncrl.transports.weights.send_digests import SAMPLE

    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    server = corrupting
    cfg = GlooWeightsConfig(bucket_mb=1, timeout_s=60, verify="sampled", repush_attempts=1)
    sender = make_weight_transport(cfg, [server.url], "cpu", "keep", "vllm")
    try:
        sender.connect()
        sender.push(((n, w + 1) for n, w in weights.items()), 1).wait(120)
        st = server.state()
        want = {n: _sha(w + 1) for n, w in weights.items()}
        assert st["sha256"]["rank0"] == want == st["sha256"]["rank1"]
        assert st["update_calls"] == 2  # the corrupted round, then the re-sent one
        assert len(_checker_calls(server)) == 2  # each round checked
        digest = sender.stream.digest  # type: ignore[attr-defined]
        assert digest.comparable == set(weights)  # the stand-in holds the tensors as sent
        assert digest.names(2, weights) <= set(weights)
        assert len(digest.names(2, weights)) == min(SAMPLE, len(weights))

        sender.push(((n, w + 2) for n, w in weights.items()), 2).wait(120)
        assert server.state()["update_calls"] == 3 and len(_checker_calls(server)) == 3
    finally:
        sender.close()

    off = make_weight_transport(
        GlooWeightsConfig(bucket_mb=1, timeout_s=60, verify="off"), [server.url], "cpu", "keep",
        "vllm",
    )  # fmt: skip
    try:
        off.connect()
        off.push(((n, w + 3) for n, w in weights.items()), 3).wait(120)  # update call 4
    finally:
        off.close()
    st = server.state()
    assert len(_checker_calls(server)) == 3  # not asked
    assert st["sha256"]["rank0"] == {n: _sha(w + 3) for n, w in weights.items()}
    assert st["sha256"]["rank1"] != st["sha256"]["rank0"]  # the fault stayed


def test_digest_rules_on_vllms_layout() -> None:
    """The comparison over answers shaped as vLLM's for a TP-2 engine (keys
    ``dp0:pp0:pcp0:tp{i}:NAME``, gpu_worker.py:380-391): a fused tensor is absent, a
    sharded one differs per rank (not comparable, never flagged), a replicated one that one
    rank got wrong is flagged even before the first check, and a comparable one flagged
    on every later push."""
    import asyncio

    from asyncrl.transports.weights.base import WeightSyncError
    from asyncrl.transports.weights.send_digests import DigestCheck

    expected = {"norm": "N", "o_proj": "O", "q_proj": "Q", "lm_head": "L"}
    answers = [
        {"norm": ("N", "N"), "o_proj": ("o0", "o1"), "lm_head": ("Lpad", "Lpad")},  # calibrates
        {"norm": ("N", "bad"), "o_proj": ("o0", "o1"), "lm_head": ("Lpad", "Lpad")},
        {"norm": ("X", "X"), "o_proj": ("o0", "o1"), "lm_head": ("Lpad", "Lpad")},
    ]

    class Engine:
        url = "http://vllm"

        def __init__(self) -> None:
            self.answer: dict[str, tuple[str, str]] = {}

    engine = Engine()

    async def checksums(e: Engine) -> dict[str, str]:
        return {f"dp0:pp0:pcp0:tp{i}:{n}": d[i] for n, d in e.answer.items() for i in range(2)}

    check = DigestCheck("full", checksums)  # type: ignore[arg-type]
    engine.answer = answers[0]
    asyncio.run(check.check(1, [engine], expected))  # type: ignore[list-item]
    assert check.comparable == {"norm"}
    for v, answer in enumerate(answers[1:], start=2):
        engine.answer = answer
        with pytest.raises(WeightSyncError, match=r"1 tensor.*norm"):
            asyncio.run(check.check(v, [engine], expected))  # type: ignore[list-item]
    fresh = DigestCheck("sampled", checksums)  # type: ignore[arg-type]
    engine.answer = answers[1]
    with pytest.raises(WeightSyncError, match="norm"):  # before any calibration
        asyncio.run(fresh.check(1, [engine], expected))  # type: ignore[list-item]
    assert fresh.comparable is None
