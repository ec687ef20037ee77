"""``weights.verify`` on the vLLM family: vLLM 0.33's ``/weight_checker`` after each push.

The other side is vLLM's own ``/weight_checker`` route (``vllm/app.py``) over the
stand-in's workers (``vllm/standin.py``): it answers as vLLM's route does (rl:232-266:
``{"checksums": {"dp0:pp0:pcp0:tp{i}:NAME": sha256}}``, every worker's every parameter,
model_loader/weight_checksum.py:32-38), each receiving rank hashing the parameters vLLM's
loader would have made of what it received: ``qkv_proj`` and ``gate_up_proj`` fused, the
vocabulary padded to 64 rows, TP shards, in the served dtype (``--dtype auto``: a float32
checkpoint in bfloat16) — ``vllm/model_layout.py``, written from vLLM's source independently
of asyncrl's ``engines/rollout/vllm/layout.py``. ``--corrupt-calls`` loads one element wrong
on the last TP rank while answering 200: a silent fault that only a check finds.
``--fail-calls`` fails an update after its receive.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrl.procs import finish, python_env
from tests.engines.rollout.vllm.server import VLLMStandIn, start_vllm

PARAMS = 17
"""vLLM's parameters of the tiny model (Qwen2, 2 layers, untied): embed_tokens, per layer
qkv_proj (weight, bias), o_proj, gate_up_proj, down_proj, 2 norms; norm, lm_head. The
trainer pushes 27 tensors (q/k/v and gate/up apart)."""


def _checker_calls(server: VLLMStandIn) -> list[dict[str, Any]]:
    return [c for c in server.wire() if c["path"] == "/weight_checker"]


@pytest.fixture(scope="module")
def corrupting(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[VLLMStandIn]:
    """One TP-2 stand-in (bfloat16, vLLM's ``auto`` for this float32 checkpoint) whose update
    calls 1 and 4 load a wrong element on rank 1."""
    server = start_vllm(tiny_model_dir, tmp_path_factory.mktemp("vllm"), 2, corrupt_calls="1,4")
    yield server
    server.stop()


def test_sampled_verify_finds_a_silent_fault_and_repushes(
    corrupting: VLLMStandIn, tiny_model_dir: Path
) -> None:
    """``verify=sampled`` against a TP-2 engine holding bfloat16, fused and padded tensors
    while float32 ones are pushed: the first check compares all 2 x 17 of them and finds the
    silent fault on rank 1; the push is re-sent as a new round (bit-exact after, every tensor
    compared and equal); the next push compares a sample of 8. The same fault under
    ``verify=off`` stays: the check, nothing else, caught it."""
    from safetensors.torch import load_file

    from asyncrl.config import GlooWeightsConfig
    from asyncrl.engines.rollout.factory import make_weight_transport
    from asyncrl.transports.weights.send_digests import SAMPLE

    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    server = corrupting
    cfg = GlooWeightsConfig(bucket_mb=1, timeout_s=60, verify="sampled", repush_attempts=1)
    sender = make_weight_transport(cfg, [server.url], "cpu", "keep", "vllm")
    try:
        sender.connect()
        stats = sender.push(((n, w + 1) for n, w in weights.items()), 1).wait(120)
        assert stats["attempts"] == 2  # the corrupted round, then the re-sent one
        assert stats["push_verify_compared"] == stats["push_verify_total"] == 2 * PARAMS
        st = server.state()
        assert st["update_calls"] == 2 and len(_checker_calls(server)) == 2
        answer = _held(server)
        assert len(answer) == 2 * PARAMS and {k.split(":")[3] for k in answer} == {"tp0", "tp1"}
        assert any("qkv_proj" in k for k in answer) and any("gate_up_proj" in k for k in answer)

        stats = sender.push(((n, w + 2) for n, w in weights.items()), 2).wait(120)
        assert stats["push_verify_compared"] == SAMPLE
        assert stats["push_verify_total"] == 2 * PARAMS
        assert server.state()["update_calls"] == 3
        assert len(_checker_calls(server)) == 4  # (one was the test's own, _held)
    finally:
        sender.close()

    off = make_weight_transport(
        GlooWeightsConfig(bucket_mb=1, timeout_s=60, verify="off"), [server.url], "cpu", "keep",
        "vllm",
    )  # fmt: skip
    try:
        off.connect()
        stats = off.push(((n, w + 3) for n, w in weights.items()), 3).wait(120)  # update call 4
    finally:
        off.close()
    assert "push_verify_compared" not in stats
    st = server.state()
    assert len(_checker_calls(server)) == 4  # not asked
    assert st["sha256"]["rank1"] != st["sha256"]["rank0"]  # the fault stayed


def _held(server: VLLMStandIn) -> dict[str, str]:
    """The stand-in's ``/weight_checker`` answer (as vLLM's route gives it)."""
    import urllib.request

    from asyncrl.secret import auth_headers

    body = json.dumps({"action": "checksum"}).encode()
    headers = {**auth_headers(), "Content-Type": "application/json"}
    req = urllib.request.Request(server.url + "/weight_checker", body, headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["checksums"]


def _vllm_answer(
    model_dir: Path, weights: dict[str, torch.Tensor], tp: int, dtype: str
) -> dict[str, str]:
    """``/weight_checker``'s answer of a TP-``tp`` engine that loaded ``weights``, built with
    the stand-in's imitation of vLLM's loader (``vllm/model_layout.py``)."""
    from tests.engines.rollout.vllm.model_layout import VLLMQwen2, served_dtype

    out = {}
    for r in range(tp):
        model = VLLMQwen2(str(model_dir), r, tp, served_dtype(str(model_dir), dtype))
        for n, w in weights.items():
            model.load(n, w)
        out.update({f"dp0:pp0:pcp0:tp{r}:{n}": d for n, d in model.digests().items()})
    return out


@pytest.mark.parametrize(("tp", "dtype"), [(1, "auto"), (2, "float16"), (4, "float32")])
def test_layout_computes_what_vllm_holds(tiny_model_dir: Path, tp: int, dtype: str) -> None:
    """asyncrl's layout (slicing and concatenating the pushed tensors) and the stand-in's
    imitation of vLLM's loader (copying each into vLLM's parameters) agree on every digest,
    for any TP and served dtype; a one-element change on one rank is named."""
    from safetensors.torch import load_file

    from asyncrl.engines.rollout.vllm.layout import VLLMDigests

    stored = load_file(str(tiny_model_dir / "model.safetensors"))
    weights = {n: w * 1.5 + 0.25 for n, w in stored.items()}
    answer = _vllm_answer(tiny_model_dir, weights, tp, dtype)
    got = VLLMDigests()(weights, answer, None, 0)
    assert (got.compared, got.total, got.wrong) == (tp * PARAMS, tp * PARAMS, [])
    bad = dict(weights)
    v = "model.layers.1.self_attn.v_proj.weight"
    bad[v] = bad[v].clone()
    bad[v][-1, -1] += 1  # its last row: on the last rank
    wrong = VLLMDigests()(weights, _vllm_answer(tiny_model_dir, bad, tp, dtype), None, 0).wrong
    assert wrong == [f"tp{tp - 1}:model.layers.1.self_attn.qkv_proj.weight"]


def test_a_layout_it_cannot_compute_fails_loudly(tiny_model_dir: Path) -> None:
    """An engine holding tensors the layout does not compute (another fusion) is not
    'partly checked': the push fails at once, not re-sent, naming what differs and
    ``weights.verify=off``; an engine that matches nothing under any dtype is a mismatch."""
    from safetensors.torch import load_file

    from asyncrl.engines.rollout.vllm.layout import VLLMDigests
    from asyncrl.transports.weights.base import WeightsUnverified, WeightSyncError
    from asyncrl.transports.weights.send_digests import DigestCheck

    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    answer = _vllm_answer(tiny_model_dir, weights, 1, "auto")
    answer["dp0:pp0:pcp0:tp0:model.layers.0.mlp.experts.w13_weight"] = "x"

    class Engine:
        url = "http://vllm"

    async def checksums(_: object) -> dict[str, str]:
        return answer

    check = DigestCheck("full", checksums, VLLMDigests())  # type: ignore[arg-type]
    with pytest.raises(WeightsUnverified, match=r"experts\.w13_weight.*weights\.verify=off"):
        asyncio.run(check.check(1, [Engine()], weights))  # type: ignore[list-item]
    del answer["dp0:pp0:pcp0:tp0:model.layers.0.mlp.experts.w13_weight"]
    for k in answer:
        answer[k] = "0" * 64
    with pytest.raises(WeightSyncError, match=r"17 of 17 tensor\(s\) differ") as info:
        asyncio.run(check.check(1, [Engine()], weights))  # type: ignore[list-item]
    assert not isinstance(info.value, WeightsUnverified)  # re-sent, as any mismatch


@pytest.mark.slow
def test_run_through_a_failed_update_recovers_fast_and_logs_counts(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """``asyncrl run --rollout.backend=vllm --weights.verify=full --weights.timeout_s=30``
    against a stand-in whose second update fails: the re-push round starts within seconds of
    the failed call (under 10 s, far below ``timeout_s``), the run finishes, and every
    push's row in metrics.jsonl says all 17 of the engine's tensors were compared."""
    server = start_vllm(tiny_model_dir, tmp_path / "vllm", fail_calls="2")
    try:
        cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--run-dir", str(tmp_path / "run")]
        cmd += ["--quiet", f"--model.path={tiny_model_dir}", "--rollout.backend=vllm"]
        cmd += [f"--rollout.urls={json.dumps([server.url])}", "--weights.backend=gloo"]
        cmd += ["--controller.total_steps=3", "--controller.batch_size=2"]
        cmd += ["--weights.bucket_mb=1", "--weights.timeout_s=30", "--weights.verify=full"]
        proc = subprocess.Popen(
            cmd, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        rc, out = finish(proc, 240)
        assert rc == 0, out + server.log.read_text()[-3000:]
        wire = [c for c in server.wire() if c["method"] == "POST" and "generate" not in c["path"]]
        k = next(i for i, c in enumerate(wire) if c["status"] >= 400)
        assert wire[k]["path"] == "/update_weights"
        again = next(c for c in wire[k + 1 :] if c["path"] == "/start_weight_update")
        resumed = next(c for c in wire[k + 1 :] if c["path"] == "/resume")
        print(f"failed update -> re-push start {again['t'] - wire[k]['t']:.3f}s, "
              f"-> resume {resumed['t'] - wire[k]['t']:.3f}s")  # fmt: skip
        assert resumed["t"] - wire[k]["t"] < 10.0
        metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
        rows = [json.loads(x) for x in metrics.splitlines()]
        pushes = [r for r in rows if "push_verify_total" in r]
        assert len(pushes) == 3, rows
        assert all(r["push_verify_compared"] == r["push_verify_total"] == PARAMS for r in pushes)
        assert max(r["attempts"] for r in rows if "attempts" in r) == 2
    finally:
        server.stop()


def test_a_failed_bucket_mid_push_is_re_pushed_at_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A push of three buckets whose first ``/update_weights`` fails (after the receive, as
    vLLM's load does): the engine never takes the later buckets' broadcasts, so the group is
    re-formed (``/init_weight_transfer_engine`` again) and the push re-sent as a new round
    at once — within 10 s of the failed call with ``timeout_s=30``, not after it — and
    lands bit-exact, every tensor compared."""
    from safetensors.torch import load_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.config import GlooWeightsConfig
    from asyncrl.engines.rollout.factory import make_weight_transport

    model_dir = tmp_path / "model"  # ~2.1 MB: three buckets of at most 1 MiB
    config = Qwen2Config.from_pretrained(tiny_model_dir)
    config.hidden_size, config.intermediate_size = 128, 512
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    server = start_vllm(model_dir, tmp_path / "vllm", fail_calls="1")
    cfg = GlooWeightsConfig(bucket_mb=1, timeout_s=30, verify="full")
    sender = make_weight_transport(cfg, [server.url], "cpu", "keep", "vllm")
    try:
        sender.connect()
        stats = sender.push(((n, w + 1) for n, w in weights.items()), 1).wait(120)
        assert stats["attempts"] == 2 and stats["buckets"] == 3
        assert stats["push_verify_compared"] == stats["push_verify_total"] == PARAMS
        wire = [c for c in server.wire() if c["method"] == "POST"]
        k = next(i for i, c in enumerate(wire) if c["status"] >= 400)
        after = [c["path"] for c in wire[k + 1 :]]
        assert after[:3] == ["/init_weight_transfer_engine", "/pause", "/start_weight_update"]
        resumed = next(c for c in wire[k + 1 :] if c["path"] == "/resume")
        assert resumed["t"] - wire[k]["t"] < 10.0
        assert server.state()["truth"] == 1
    finally:
        sender.close()
        server.stop()
