"""Collective weight sync (Gloo) into real embedded-engine processes over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from asyncrl.config import GlooWeightsConfig, WeightSyncConfig
from asyncrl.engines.rollout.factory import make_weight_transport
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.procs import free_port, python_env, stop
from asyncrl.secret import auth_headers
from asyncrl.transports.weights.base import WeightSyncError
from asyncrl.transports.weights.bucket import checksum
from tests.runs import spawn_shared

CFG = GlooWeightsConfig(bucket_mb=1, min_buckets=2, timeout_s=60.0)
ENGINE = ["-m", "asyncrl.entrypoints.engine"]
FAULTY = ["-m", "tests.transports.weights.faulty_engine"]  # the engine, failing as told (forked)


def tied_qwen2(tmp_path_factory: pytest.TempPathFactory, vocab_size: int) -> Path:
    """A one-layer tied-embedding Qwen2 (hidden 64, seed 0) saved in a new folder: its
    embedding is ``vocab_size`` x 64 values."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("weights") / "model"
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small tied-embedding Qwen2 whose embedding (1.5 MB) is larger than a 1 MiB bucket."""
    return tied_qwen2(tmp_path_factory, vocab_size=6000)


def _model_weights(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(seed)
    return {n: torch.randn_like(p) for n, p in model.named_parameters()}


@contextlib.contextmanager
def engines(
    model_dir: Path, tmp: Path, faults: list[str], device: str = "cpu"
) -> Iterator[list[str]]:
    """Start one engine process per entry of ``faults`` ("" = healthy: the real engine;
    else the test-only ``faulty_engine`` with those faults); stop them by pid."""
    procs: list[subprocess.Popen] = []
    urls = []
    try:
        for i, fault in enumerate(faults):
            port = free_port()
            args = [*(FAULTY if fault else ENGINE), "--model-path", str(model_dir)]
            args += ["--faults", fault] if fault else []
            args += ["--port", str(port), "--device", device]
            procs.append(spawn_shared(args, tmp / f"engine{i}_{port}.log", python_env()))
            urls.append(f"http://127.0.0.1:{port}")
        asyncio.run(_healthy(urls))
        yield urls
    finally:
        stop(procs)


async def _healthy(urls: list[str]) -> None:
    clients = [SGLangClient(u) for u in urls]
    try:
        await asyncio.gather(*(c.wait_healthy(180) for c in clients))
    finally:
        await asyncio.gather(*(c.close() for c in clients))


async def _state(url: str) -> tuple[str, dict[str, int]]:
    client = SGLangClient(url)
    try:
        out = await client._call("GET", "/get_weights_checksum")
    finally:
        await client.close()
    return out["weight_version"], out["checksums"]


def state(url: str) -> tuple[str, dict[str, int]]:
    return asyncio.run(_state(url))


def expected(weights: dict[str, torch.Tensor]) -> dict[str, int]:
    return {n: checksum(t.float().contiguous()) for n, t in weights.items()}


@pytest.fixture(scope="module")
def pair(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two engines; the second corrupts bucket 1 of v11 and fails bucket 1 of v21."""
    with engines(
        model_dir, tmp_path_factory.mktemp("logs"), ["", "corrupt:1@11,fail:1@21"]
    ) as urls:
        yield urls


def push(
    urls: list[str],
    pushes: list[tuple[dict[str, torch.Tensor], int]],
    cfg: WeightSyncConfig = CFG,
) -> list:
    """Connect a sender to ``urls``, push each (weights, version), return stats or errors;
    the stats say whether the push chunked a tensor."""
    sender = make_weight_transport(cfg, urls, "cpu")

    def chunked(stats: dict) -> None:
        stats["chunked"] = any(not e.whole for m in sender.stager.plan for e in m.entries)

    return push_each(sender, pushes, 60, chunked)


def push_each(
    sender: Any,
    pushes: list[tuple[dict[str, torch.Tensor], int]],
    timeout_s: float,
    note: Callable[[dict], None] | None = None,
) -> list:
    """Connect ``sender``, push each (weights, version) in turn, close it: the stats of each
    push (``note`` adds to them) or its WeightSyncError."""
    out: list = []
    try:
        sender.connect()
        for w, version in pushes:
            handle = sender.push(w.items(), version)
            handle.wait_snapshot(timeout_s)
            try:
                out.append(handle.wait(timeout_s))
            except WeightSyncError as exc:
                out.append(exc)
            if note is not None and isinstance(out[-1], dict):
                note(out[-1])
    finally:
        sender.close()
    return out


def test_push_to_several_engines_with_chunks_and_mixed_dtypes(
    pair: list[str], model_dir: Path
) -> None:
    ws = [_model_weights(model_dir, seed=v) for v in (1, 2)]
    # norms travel as bf16 (the engines hold float32): mixed-dtype buckets
    ws = [{n: t.bfloat16() if "norm" in n else t for n, t in w.items()} for w in ws]
    stats = push(pair, [(ws[0], 1), (ws[1], 2)])
    assert all(isinstance(s, dict) and s["buckets"] >= 3 for s in stats), stats  # chunked + bf16
    assert all(s["chunked"] for s in stats)  # the 1.5 MB embedding spans two 1 MiB buckets
    for url in pair:
        assert state(url) == ("2", expected(ws[1]))


def test_flat_trainer_weights_go_without_staging_copies_or_checksums(
    pair: list[str], model_dir: Path
) -> None:
    """Weights that are views of one flat buffer are broadcast from it (weights.zero_copy_frac)
    and, with weights.verify = off, travel without checksums; delivery stays bit-exact."""
    w = _model_weights(model_dir, seed=5)
    flat = torch.cat([t.reshape(-1) for t in w.values()])
    views, off = {}, 0
    for n, t in w.items():
        views[n] = flat[off : off + t.numel()].view(t.shape)
        off += t.numel()
    cfg = msgspec.structs.replace(CFG, zero_copy_frac=1.0, verify="off")
    sender = make_weight_transport(cfg, pair, "cpu")
    try:
        sender.connect()
        sender.push(views.items(), 5).wait(60)
        plan = sender.stager.plan
        assert len(plan) == 2 and any(not e.whole for m in plan for e in m.entries)  # chunked
        assert all(sender.stager.zero_copy(k, views) is not None for k in range(len(plan)))
        assert sender.stager.slots == {}  # nothing staged: no staging memory allocated either
    finally:
        sender.close()
    for url in pair:
        assert state(url) == ("5", expected(w))


def test_checksum_mismatch_keeps_old_weights_then_next_push_succeeds(
    pair: list[str], model_dir: Path
) -> None:
    """weights.verify = full catches a lone flipped byte (sampled need not: test_integrity)."""
    before = [state(u) for u in pair]
    w = _model_weights(model_dir, seed=12)
    full = msgspec.structs.replace(CFG, verify="full")
    failed, ok = push(pair, [(_model_weights(model_dir, seed=11), 11), (w, 12)], full)
    assert isinstance(failed, WeightSyncError) and "checksum mismatch on bucket 1" in str(failed)
    assert pair[1] in str(failed)
    assert isinstance(ok, dict)
    after = [state(u) for u in pair]
    assert after == [("12", expected(w))] * 2 and after != before


def test_engine_failing_mid_update_is_reported_and_nobody_switches(
    pair: list[str], model_dir: Path
) -> None:
    w20 = _model_weights(model_dir, seed=20)
    push(pair, [(w20, 20)])
    failed = push(pair, [(_model_weights(model_dir, seed=21), 21)])[0]
    assert isinstance(failed, WeightSyncError), failed
    assert pair[1] in str(failed) and "injected failure" in str(failed)
    assert [state(u) for u in pair] == [("20", expected(w20))] * 2  # nobody switched
    w22 = _model_weights(model_dir, seed=22)
    assert isinstance(push(pair, [(w22, 22)])[0], dict)
    assert [state(u) for u in pair] == [("22", expected(w22))] * 2


def test_restarted_engine_rejoins_and_gets_current_weights(
    pair: list[str], model_dir: Path, tmp_path: Path
) -> None:
    w = _model_weights(model_dir, seed=31)
    sender = make_weight_transport(CFG, pair, "cpu")
    try:
        sender.connect()
        sender.push(w.items(), 31).wait(60)
        with engines(model_dir, tmp_path, [""]) as fresh:  # engine 1 "restarted" elsewhere
            assert state(fresh[0])[0] == "0"
            sender.connect([pair[0], fresh[0]])  # group torn down and formed anew
            sender.push(w.items(), 31).wait(60)  # the current weights, again
            assert state(fresh[0]) == ("31", expected(w))
            assert state(pair[0]) == ("31", expected(w))
    finally:
        sender.close()


async def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    import aiohttp

    async with (
        aiohttp.ClientSession(headers=auth_headers()) as http,
        http.post(url + path, json=body) as resp,
    ):
        return resp.status, await resp.json()


def test_malformed_requests_get_400_and_closed_groups_are_gone(pair: list[str]) -> None:
    path = "/update_weights_from_distributed"
    status, out = asyncio.run(_post(pair[0], path, {"group_name": "nope", "names": ["x"]}))
    assert status == 400 and "init_weights_update_group" in out["error"]["message"]
    status, out = asyncio.run(_post(pair[0], "/init_weights_update_group", {"world_size": 2}))
    assert status == 400 and "master_address" in out["error"]["message"]
    assert state(pair[0])[0]  # still serving
    # the senders of the tests above closed: their group is torn down on the engines too
    body = {"group_name": CFG.group_name, "names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}
    status, out = asyncio.run(_post(pair[1], path, body))
    assert status == 400 and "no weight update group" in out["error"]["message"]


async def _greedy(url: str, prompt: list[int]) -> list[int]:
    client = SGLangClient(url)
    try:
        out = await client.generate(prompt, {"max_new_tokens": 12, "temperature": 0.0})
    finally:
        await client.close()
    return list(out.output_ids)


def _served(url: str) -> tuple[tuple[str, dict[str, int]], list[int]]:
    """Every served tensor's checksum, the version, and a greedy generation."""
    return state(url), asyncio.run(_greedy(url, [3, 5, 7, 9, 11]))


@pytest.fixture
def fresh(model_dir: Path, tmp_path: Path) -> Iterator[str]:
    with engines(model_dir, tmp_path, [""]) as urls:
        yield urls[0]


def test_failed_push_after_mixed_dtype_push_changes_nothing_served(
    fresh: str, model_dir: Path
) -> None:
    """Receive buffers never alias served parameters: v2 converts the norms (bf16 -> fp32),
    then an all-fp32 push laid out like v1 (its buckets fit v1's receive buffers, which the
    norms were views of) that fails its final check (one tensor transposed: same size,
    wrong shape) leaves every served tensor and the greedy output exactly as v2 left them."""
    v1, v2, v3 = (_model_weights(model_dir, seed=s) for s in (41, 42, 43))
    v2 = {n: t.bfloat16() if "norm" in n else t for n, t in v2.items()}
    name = "model.layers.0.mlp.down_proj.weight"
    v3[name] = v3[name].t().contiguous()  # same number of elements, wrong shape
    ok1, ok2 = push([fresh], [(v1, 1), (v2, 2)])
    assert isinstance(ok1, dict) and isinstance(ok2, dict), (ok1, ok2)
    before = _served(fresh)
    assert before[0] == ("2", expected(v2))
    failed = push([fresh], [(v3, 3)])[0]
    assert isinstance(failed, WeightSyncError) and name in str(failed), failed
    assert _served(fresh) == before


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("int32", "int32"),
        ("float64", "float64"),
        ("subset", "missing"),
    ],
)
def test_push_of_wrong_dtype_or_a_subset_is_refused(
    fresh: str, model_dir: Path, change: str, reason: str
) -> None:
    """Integer or float64 data is never cast into float32 parameters, and a push of only
    some parameters never bumps the version: both fail with the reason, nothing changes."""
    w1 = _model_weights(model_dir, seed=51)
    assert isinstance(push([fresh], [(w1, 1)])[0], dict)
    before = state(fresh)
    w2 = _model_weights(model_dir, seed=52)
    if change == "subset":
        w2 = dict(list(w2.items())[:2])
    else:
        name = "model.norm.weight"
        w2[name] = w2[name].to(getattr(torch, change))
    failed = push([fresh], [(w2, 2)])[0]
    assert isinstance(failed, WeightSyncError) and reason in str(failed), failed
    assert state(fresh) == before
