"""The vLLM client against vLLM 0.33's own API server code (``vllm/app.py``) over an
engine core written from vLLM's source (``vllm/standin.py``), and asyncrl's buckets
against vLLM's own packing code (``packed_tensor.py``, loaded from vLLM's source: it runs
on a CPU)."""

from __future__ import annotations

import asyncio
import json
import math
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncrl.config import VLLMRolloutConfig
from asyncrl.core import GenerateRequest
from asyncrl.engines.rollout.base import EngineUnavailable
from asyncrl.engines.rollout.launcher import KEYED, ServerSite, launch_command
from asyncrl.engines.rollout.vllm import auth
from asyncrl.engines.rollout.vllm.auth import MIDDLEWARE
from asyncrl.engines.rollout.vllm.client import VLLMClient, expand_spans, vllm_sampling
from asyncrl.engines.rollout.vllm.control import packed_chunks
from asyncrl.engines.rollout.vllm.launcher import VLLM_CLI, vllm_spec
from asyncrl.entrypoints.keyed import keyed_argv
from asyncrl.secret import auth_headers
from asyncrl.transports.weights.bucket import BucketManifest, pack_into, plan_buckets, spec_of
from tests.engines.rollout.vllm.code import packed_tensor
from tests.engines.rollout.vllm.server import VLLMStandIn, start_vllm, vllm_parse

SP = {"max_new_tokens": 30, "ignore_eos": True}


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[VLLMStandIn]:
    server = start_vllm(tiny_model_dir, tmp_path_factory.mktemp("vllm"), step_s=0.02)
    yield server
    server.stop()


def _post(server: VLLMStandIn, path: str, body: object = None) -> None:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        server.url + path, data=data, method="POST", headers=auth_headers()
    )
    req.add_header("Content-Type", "application/json")
    urllib.request.urlopen(req, timeout=30).close()


async def _until_tokens(server: VLLMStandIn, rid: str, n: int = 3) -> None:
    for _ in range(600):
        r = server.state()["reqs"].get(rid)
        if r is not None and len(r["truth"]) >= n:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"request {rid} made no {n} tokens on {server.url}")


async def test_generate_and_stream(vllm: VLLMStandIn) -> None:
    c = VLLMClient(vllm.url, record=True)
    try:
        one = await c.generate([1, 3, 4], SP, rid="g1")
        assert len(one.output_ids) == 30 == len(one.logprobs) and one.finish_reason == "length"
        assert one.token_versions() == [0] * 30  # vLLM's "default" label
        parts = [p async for p in c.generate_stream([1, 3, 4], SP, rid="g2")]
        assert len(parts) >= 2 and parts[-1].finish_reason == "length"
        assert [len(p.output_ids) for p in parts] == sorted(len(p.output_ids) for p in parts)
        assert len(parts[-1].output_ids) == 30 and parts[-1].versions == [0] * 30
        assert parts[0].versions is None  # spans only on the last chunk
        assert c.sent is not None
        body = c.sent[0][2]
        assert body["token_ids"] == [1, 3, 4] and body["stream"] is False
        assert body["sampling_params"] == {"logprobs": 0, "detokenize": False,
                                           "max_tokens": 30, "ignore_eos": True}  # fmt: skip
    finally:
        await c.close()


async def test_keep_pause_spans_versions_without_abort(vllm: VLLMStandIn) -> None:
    """``keep``: the request is frozen, the label changes, it goes on: two spans."""
    c = VLLMClient(vllm.url)
    try:
        task = asyncio.ensure_future(c.generate([1, 2], {**SP, "max_new_tokens": 60}, rid="k1"))
        await _until_tokens(vllm, "k1")
        await c.pause_generation("keep")
        assert await c.is_paused()
        _post(vllm, "/update_weight_version", {"new_version": "7"})
        await c.continue_generation()
        res = await asyncio.wait_for(task, 60)
        st = vllm.state()
        truth_labels = st["reqs"]["k1"]["labels"]
        assert res.finish_reason == "length"
        assert res.token_versions() == [0 if x == "default" else int(x) for x in truth_labels]
        assert 0 in res.token_versions() and res.token_versions()[-1] == 7
        # sent with clear_cache=false: the kept request keeps its KV (no re-prefill)
        pauses = [w for w in vllm.wire() if w["path"] == "/pause"]
        assert pauses[-1]["query"] == {"mode": "keep", "clear_cache": "false"}
        assert st["reqs"]["k1"]["prefills"] == 1
    finally:
        await c.close()


async def test_keep_without_clear_cache_false_re_prefills(vllm: VLLMStandIn) -> None:
    """What the client avoids: ``POST /pause?mode=keep`` alone takes vLLM's default
    ``clear_cache=true`` (rl:35) and the engine core then resets the running requests
    (core.py:930-953): the kept request is re-prefilled."""
    c = VLLMClient(vllm.url)
    try:
        task = asyncio.ensure_future(c.generate([1, 2], {**SP, "max_new_tokens": 60}, rid="k2"))
        await _until_tokens(vllm, "k2")
        resets = vllm.state()["cache_resets"]
        _post(vllm, "/pause?mode=keep", None)
        assert await c.is_paused()
        await c.continue_generation()
        await asyncio.wait_for(task, 60)
        st = vllm.state()
        assert st["cache_resets"] == resets + 1 and st["reqs"]["k2"]["prefills"] == 2
    finally:
        await c.close()


@pytest.mark.parametrize("mode", ["abort", "wait"])
async def test_new_requests_wait_out_a_503_pause(vllm: VLLMStandIn, mode: str) -> None:
    """``abort``/``wait``: vLLM answers new requests 503 until /resume; the client waits."""
    c = VLLMClient(vllm.url)
    try:
        await c.pause_generation(mode)
        pending = asyncio.ensure_future(c.generate([1, 2], SP, rid=f"p-{mode}"))
        streamed = asyncio.ensure_future(_drain(c, f"s-{mode}"))
        for _ in range(100):
            await asyncio.sleep(0.02)
            got = [w for w in vllm.wire() if w["status"] == 503 or "503" in w["note"]]
            if len(got) >= 2:
                break
        assert not pending.done() and not streamed.done()  # waiting, not failed
        await c.continue_generation()
        res = await asyncio.wait_for(pending, 60)
        assert res.finish_reason == "length" and len(res.output_ids) == 30
        assert (await asyncio.wait_for(streamed, 60)) == 30
    finally:
        await c.close()


async def _drain(c: VLLMClient, rid: str) -> int:
    parts = [p async for p in c.generate_stream([1, 2], SP, rid=rid)]
    return len(parts[-1].output_ids)


async def test_generate_batch_sends_a_group_as_one_request_with_n(vllm: VLLMStandIn) -> None:
    """Three equal prompts and one other: two requests, the group's with ``n = 3`` named by
    its first rid; each result is the stand-in's child ``{i}_{rid}`` (parallel_sampling.py:
    84-96) in index order. Aborting any member's rid aborts the group (sent as the engine's
    id ``generate-tokens-{rid}``, tito/serving.py:202-204)."""
    c = VLLMClient(vllm.url, record=True)
    try:
        sp = {**SP, "max_new_tokens": 6}
        group = [GenerateRequest([1, 3], sp, rid) for rid in ("n0", "n1", "n2")]
        out = await c.generate_batch([*group, GenerateRequest([4], sp, "x")])
        assert c.sent is not None
        bodies = sorted(
            (b for _, p, b in c.sent if p.endswith("generate")), key=lambda b: b["request_id"]
        )
        assert [(b["request_id"], b["sampling_params"].get("n")) for b in bodies] == [
            ("n0", 3),
            ("x", None),
        ]
        st = vllm.state()["reqs"]
        for i, res in enumerate(out[:3]):
            child = st[f"{i}_n0"]
            labels = [0 if x == "default" else int(x) for x in child["labels"]]
            assert res.output_ids == child["output"] and res.token_versions() == labels
            assert child["ext"] == "generate-tokens-n0" and len(res.logprobs) == 6
        assert out[3].output_ids == st["x"]["output"]

        long = {**SP, "max_new_tokens": 500}
        pair = [GenerateRequest([2], long, "b0"), GenerateRequest([2], long, "b1")]
        task = asyncio.ensure_future(c.generate_batch(pair))
        await _until_tokens(vllm, "1_b0")
        await c.abort_request("b1")  # a member: vLLM aborts the parent with its children
        res = await asyncio.wait_for(task, 30)
        assert [r.finish_reason for r in res] == ["abort", "abort"]
        assert c.sent[-1][2] == {"request_ids": ["generate-tokens-b0"]}
        with pytest.raises(ValueError, match="generate_batch"):
            await c.generate([1], {**SP, "n": 2})
    finally:
        await c.close()


async def test_a_stream_with_n_interleaves_its_choices(vllm: VLLMStandIn) -> None:
    """vLLM streams ``n = 2`` as one choice per chunk with its ``index``, the children's
    chunks interleaved (tito/serving.py:681-754), each child's spans on its last chunk: the
    stand-in plays it so; the client's ``generate_stream`` (one completion) refuses ``n``."""
    import aiohttp

    sp = {"n": 2, "max_tokens": 12, "ignore_eos": True, "logprobs": 0}
    body = {"request_id": "sn", "token_ids": [1, 3], "stream": True, "sampling_params": sp}
    chunks = []
    async with aiohttp.ClientSession(headers=auth_headers()) as http:
        async with http.post(vllm.url + "/inference/v1/generate", json=body) as resp:
            async for line in resp.content:
                text = line.decode().strip()
                if text.startswith("data: ") and text != "data: [DONE]":
                    chunks.append(json.loads(text[6:]))
    order = [c["choices"][0]["index"] for c in chunks]
    assert all(len(c["choices"]) == 1 for c in chunks) and set(order) == {0, 1}
    assert order != sorted(order), order  # interleaved as the children decode
    st = vllm.state()["reqs"]
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert [t for m in mine for t in m["token_ids"]] == st[f"{i}_sn"]["output"]
        assert [m["finish_reason"] for m in mine][-1] == "length"
        spans = [m["weight_versions"] is not None for m in mine]
        assert spans == [False] * (len(mine) - 1) + [True]
    c = VLLMClient(vllm.url)
    try:
        with pytest.raises(ValueError, match="generate_batch"):
            [p async for p in c.generate_stream([1, 3], {**SP, "n": 2})]
    finally:
        await c.close()


async def test_abort_one_request_and_the_503_deadline(vllm: VLLMStandIn) -> None:
    c = VLLMClient(vllm.url, retry_503_s=0.3)
    try:
        task = asyncio.ensure_future(c.generate([1], {**SP, "max_new_tokens": 500}, rid="a1"))
        await _until_tokens(vllm, "a1")
        await c.abort_request("a1")
        res = await asyncio.wait_for(task, 30)
        assert res.finish_reason == "abort" and 0 < len(res.output_ids) < 500
        await c.pause_generation("abort")
        with pytest.raises(EngineUnavailable, match="paused for over"):
            await c.generate([1], SP)
        await c.continue_generation()
        assert await c.get_weight_version() in ("default", "7")
        assert await c.health()
    finally:
        await c.close()


def test_spans_and_sampling() -> None:
    spans = [{"version": "default", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 5}]
    assert expand_spans(spans, 5) == [0, 0, 3, 3, 3]
    assert expand_spans(None, 2) == [0, 0]
    with pytest.raises(ValueError, match="no vLLM equivalent"):
        vllm_sampling({"regex": "x"})


def test_buckets_are_vllm_packed_chunks() -> None:
    """asyncrl's bucket bytes equal vLLM's own ``pack_tensors`` for the same tensors, cut at
    the same places (vLLM's chunk-closing rule), and vLLM's ``unpack_tensor`` rebuilds them."""
    pt = packed_tensor()
    g = torch.Generator().manual_seed(0)
    named = {f"w{i}": torch.randn(s, generator=g) for i, s in enumerate([(7, 5), (300,), (2, 3)])}
    named["big"] = torch.randn(400, generator=g)  # over the cap alone: a chunk of its own
    cap = 1600
    specs = [spec_of(n, t) for n, t in named.items()]
    plan = plan_buckets(specs, cap, 1, whole_only=True)
    for m in plan:
        flat = torch.empty(sum(e.size for e in m.entries), dtype=getattr(torch, m.dtype))
        pack_into(flat, m, named)
        names = [e.name for e in m.entries]
        sizes = [math.prod(e.shape) * 4 for e in m.entries]
        assert packed_chunks(sizes, cap) == [list(range(len(names)))]  # one vLLM chunk
        chunk = pt.pack_tensors(iter([(n, named[n]) for n in names]), lambda x: x[1], cap)
        assert torch.equal(chunk.packed_tensor, flat.view(torch.uint8))
        shapes = [list(named[n].shape) for n in names]
        f32 = [torch.float32] * len(names)
        rebuilt = pt.unpack_tensor(flat.view(torch.uint8), names, shapes, f32, sizes)
        assert all(torch.equal(t, named[n]) for n, t in rebuilt)
    assert isinstance(plan[0], BucketManifest)
    # the rule itself, against vLLM's producer over a stream of tensors
    stream = list(named.items())
    it = iter(stream)
    got = []
    while (chunk := pt.pack_tensors(it, lambda x: x[1], cap)) is not None:
        got.append(chunk.names)
    sizes = [t.numel() * 4 for _, t in stream]
    assert got == [[stream[i][0] for i in c] for c in packed_chunks(sizes, cap)]


def test_launch_command() -> None:
    rc = VLLMRolloutConfig(tp_size=2, gpu_memory_utilization=0.5, dtype="bfloat16")
    spec = vllm_spec(rc, ServerSite("/m", 8000, "127.0.0.1", 2, 7, "bfloat16", "127.0.0.1"))
    assert spec.entry_point == (VLLM_CLI, "serve")
    assert spec.env["VLLM_SERVER_DEV_MODE"] == "1" and spec.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    args = list(spec.extra_args)
    assert args[0] == "/m" and args[args.index("--tensor-parallel-size") + 1] == "2"
    assert json.loads(args[args.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.5"
    # the run secret as vLLM's --api-key (common/cli_args.py:335), added in memory by
    # asyncrl.entrypoints.keyed: the command line carries the flag's name only
    cmdline = launch_command(spec)
    assert cmdline[:4] == ["-m", KEYED, "--api-key", "--"] and "--api-key" not in args
    kind, _, argv = keyed_argv(cmdline[4:], "--api-key", "-s3cret-0123456789abcdef")
    assert kind == "-c" and argv[:2] == ["-c", "serve"]
    assert argv[-1] == "--api-key=-s3cret-0123456789abcdef"  # one word: a leading "-" is kept
    # every route guarded by the run secret: vLLM's --middleware (common/cli_args.py:361,
    # append action :406-411); the generate route needs --enable-scale-out (:216). The argv
    # as vLLM's own `vllm serve` parser reads it:
    assert f"--middleware={MIDDLEWARE}" in args
    assert MIDDLEWARE == f"{auth.__name__}.{auth.RunSecretMiddleware.__name__}"
    got, bad = vllm_parse(argv[2:], [*argv[2:], "--no-such-flag"])
    assert isinstance(got, dict) and isinstance(bad, str)
    assert "unrecognized arguments: --no-such-flag" in bad  # what `vllm serve` refuses
    assert got["middleware"] == [MIDDLEWARE] and got["api_key"] == ["-s3cret-0123456789abcdef"]
    assert got["enable_scale_out"] is True and got["model"] == "/m"
    assert got["tensor_parallel_size"] == 2
    assert not any("s3cret" in a for a in cmdline)  # the key is in memory only
