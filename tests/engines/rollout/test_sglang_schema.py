"""Every request the SGLang client sends, and the answers it reads, judged by SGLang's code.

The client talks to a real server (the embedded engine) with ``record=True``;
what it sent and got goes to ``tests/engines/rollout/sglang/wire_schema.py``,
run once per covered SGLang version with that version's source
(``.cache/sglang/V``) first on the path. There, SGLang's own code decides: the
routes and methods of its ``http_server.py``, its request classes from
``io_struct.py`` parsed as FastAPI parses them (pydantic), its ``SamplingParams``,
its ``/generate`` contract gate and response types where the version has them.
Nothing in this file restates SGLang's schema; what differs by version is
stated below, with the line of SGLang's source that makes it so.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import pytest
import torch

from asyncrl.config import PAUSE_MODES
from asyncrl.core import GenerateRequest
from asyncrl.engines.rollout.base import BucketAnnouncement, EngineError, TensorLoad
from asyncrl.engines.rollout.launcher import LaunchedServer
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.transports.weights.bucket import pack_into, plan_buckets, spec_of
from asyncrl.transports.weights.collective_wire import broadcast, bucket_extra
from tests.engines.rollout.sglang.code import VERSIONS, sglang_src
from tests.engines.rollout.sglang.forks import probe

# Routes asyncrl may call that a version does not have, and why that is fine:
ABSENT = {
    # the weight-update session came with 0.5.22 (http_server.py:1423-1452 there): the
    # client reads the 404 as "no session" and goes on without (tested: standin 0.5.10)
    "0.5.10": {"/begin_weight_update", "/end_weight_update"},
    # /get_weight_version was removed after 0.5.10 (http_server.py:581-587 there): the
    # client asks /model_info first (every version has it) and falls back only on a 404
    "0.5.22": {"/get_weight_version"},
    "0.5.23": {"/get_weight_version"},
}
IGNORED = {  # fields SGLang drops (FastAPI ignores keys its body class does not define)
    "/update_weights_from_distributed": ["asyncrl_bucket"],  # asyncrl's bucket manifest
}


def _run_judge(version: str, payload: str) -> dict[str, Any]:
    return dict(probe(version, "tests.engines.rollout.sglang.wire_schema", json.loads(payload)))


@functools.cache
def _judges(payload: str) -> dict[str, Future[dict[str, Any]]]:
    """Every version's judge started at once on ``payload`` (each imports its SGLang: most
    of their time), so the first test waits for one judge and the next versions' are done."""
    pool = ThreadPoolExecutor(len(VERSIONS))
    try:
        return {v: pool.submit(_run_judge, v, payload) for v in VERSIONS}
    finally:
        pool.shutdown(wait=False)


def _judge(version: str, payload: str) -> dict[str, Any]:
    sglang_src(version)  # skips, naming why, when that version's source is absent
    return _judges(payload)[version].result(timeout=300)


def judge(version: str, requests: list[Any], answers: list[Any]) -> dict[str, Any]:
    """The report of ``wire_schema`` run with SGLang ``version``'s source (one process per
    version and payload)."""
    return _judge(version, json.dumps({"requests": requests, "answers": answers}))


DRIFT = [  # what SGLang's code must reject (test_sglangs_code_rejects_drift)
    ["POST", "/generate", {"input_ids": [1, 2], "return_logprob": True}],  # fine
    ["POST", "/generate", {"input_ids": ["x"], "return_logprob": True}],
    ["POST", "/generate", {"input_ids": [1], "sampling_params": {"max_tokens": 3}}],
    ["POST", "/generate", {"prompt_ids": [1]}],
    ["GET", "/pause_generation", {"mode": "abort"}],
    ["POST", "/pause_generation", {"mode": "hold"}],
    ["POST", "/update_weight_version", {"version": "1"}],
    ["POST", "/init_weights_update_group", {"master_address": "h"}],
    ["POST", "/nonexistent_route", {}],
]


def reports(version: str, recorded: tuple[list, list]) -> tuple[dict[str, Any], list[Any]]:
    """One judge process per version for every test here: the report on the recorded
    requests and answers, and the judged :data:`DRIFT` requests (sent after them)."""
    requests, answers = recorded
    report = dict(judge(version, [*requests, *DRIFT], answers))
    judged = report["requests"]
    report["requests"] = judged[: len(requests)]
    return report, judged[len(requests) :]


async def _exercise(client: SGLangClient, pusher: Any) -> None:
    """Every request the client makes, with the argument shapes the run uses."""
    sp = {"max_new_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5}
    await client.generate([1, 3, 4], {**sp, "stop_token_ids": [2], "ignore_eos": False})
    await client.generate([1, 3], {"max_new_tokens": 2}, rid="7-1.")
    batch = [{"max_new_tokens": 2}, {"max_new_tokens": 3, "temperature": 0}]
    await client.generate_batch(
        [GenerateRequest([1, 3, 4], batch[0], "8-1."), GenerateRequest([1, 3, 4], batch[1], "8-2.")]
    )
    await client.abort_request("7-1.")
    await client.abort_request(abort_all=True)
    for mode in PAUSE_MODES:
        await client.pause_generation(mode)
        await client.continue_generation()
    await client.flush_cache()
    await client.begin_weight_update()  # 404 here; its body is still judged
    await pusher.connect(client, "schema_group")
    await pusher.push(client, pusher.original, "3")
    # the SGLang path's bucket call: flush_cache off, the label with the last bucket, the
    # manifest in a field SGLang ignores (collective_send.py _announce)
    tensors = {n: t.float() for n, t in pusher.original.items()}
    plan = plan_buckets(tuple(spec_of(n, t) for n, t in tensors.items()), 1 << 30, 1, True)
    m = msgspec.structs.replace(plan[0], version=4)  # one bucket; no checksum (verify off)
    flat = torch.empty(m.nbytes, dtype=torch.uint8).view(m.torch_dtype)
    pack_into(flat, m, tensors)
    names = [e.name for e in m.entries]
    bucket = BucketAnnouncement(
        names=names,
        dtypes=[m.dtype] * len(names),
        shapes=[e.wire_shape for e in m.entries],
        group_name="schema_group",
        flush_cache=False,
        weight_version="4",
        load_format="flattened_bucket",
        extra={"asyncrl_bucket": bucket_extra(m)},
    )
    call = client.update_weights_from_distributed(bucket)
    await asyncio.gather(asyncio.to_thread(broadcast, pusher.group, flat), call)
    with contextlib.suppress(EngineError):  # the payload is not a real tensor handle
        await client.update_weights_from_tensor(
            TensorLoad(["aGVsbG8="], "flattened_bucket", True, "3")
        )
    await client.end_weight_update()
    await client.update_weight_version("4")
    assert await client.get_weight_version() == "4"
    assert await client.health()
    await client.get_server_info()
    await client.destroy_weights_update_group("schema_group")
    await client.update_weight_version("0")


@pytest.fixture(scope="module")
def recorded(engine_server: LaunchedServer, weight_pusher: Any) -> tuple[list, list]:
    async def go() -> tuple[list, list]:
        client = SGLangClient(engine_server.url, record=True)
        try:
            await _exercise(client, weight_pusher)
        finally:
            await client.close()
        assert client.sent is not None and client.answers is not None
        return [list(x) for x in client.sent], [list(x) for x in client.answers]

    return asyncio.run(go())


@pytest.mark.parametrize("version", VERSIONS)
def test_routes_and_methods_exist_in_sglangs_http_server(
    version: str, recorded: tuple[list, list]
) -> None:
    requests, _ = recorded
    report, _ = reports(version, recorded)
    missing = {r["path"] for r in report["requests"] if not r["route"]}
    sent = {p for _, p, _ in requests}
    assert missing == ABSENT[version] & sent, missing  # (after a 404 the client stops asking)
    methods = [p for r in report["requests"] if r["route"] for p in r["problems"] if "serves" in p]
    assert methods == []
    assert sent >= {"/generate", "/update_weights_from_distributed", "/update_weight_version"}
    assert "/model_info" in report["routes"] and "/server_info" in report["routes"]


@pytest.mark.parametrize("version", VERSIONS)
def test_bodies_parse_into_sglangs_request_classes(
    version: str, recorded: tuple[list, list]
) -> None:
    """Each body through pydantic into the route's io_struct class (as FastAPI does), then
    GenerateReqInput's own normalization, SamplingParams, and the 0.5.22+ contract gate."""
    report, _ = reports(version, recorded)
    judged = [r for r in report["requests"] if r["route"]]
    for r in judged:
        assert r["problems"] == [], r
        assert set(r.get("ignored", [])) <= set(IGNORED.get(r["path"], [])), r
    dropped = [r for r in judged if r.get("ignored")]
    assert dropped and all(r["path"] == "/update_weights_from_distributed" for r in dropped)
    bodies = {r["cls"] for r in judged if r["cls"] and not r.get("cls_left_out")}
    want = {"UpdateWeightsFromDistributedReqInput", "AbortReq", "PauseGenerationReqInput"}
    want |= {"ContinueGenerationReqInput", "UpdateWeightVersionReqInput"}
    want |= {"InitWeightsUpdateGroupReqInput", "UpdateWeightsFromTensorReqInput"}
    want |= {"DestroyWeightsUpdateGroupReqInput"}
    if version >= "0.5.22":
        want |= {"BeginWeightUpdateReqInput"}  # (its 404 here: no /end_weight_update sent)
    assert want <= bodies, want - bodies
    # GenerateReqInput's class body needs schedule_batch's names, which reach torchvision:
    # its bodies are judged by SamplingParams and (0.5.22+) the contract gate instead
    generate = [r for r in judged if r["path"] == "/generate"]
    assert generate and all(r.get("cls_left_out") for r in generate)
    assert report["contract_gate"] == (version >= "0.5.22")


@pytest.mark.parametrize("version", VERSIONS)
def test_answers_hold_to_sglangs_response_types(version: str, recorded: tuple[list, list]) -> None:
    """0.5.22+: SGLang's API types decode every /generate, /model_info and /server_info answer
    the client read, and narrowing an answer to those types changes nothing the client reads;
    0.5.10 (no API types): every key the client reads is one SGLang's code builds."""
    got = reports(version, recorded)[0]["answers"]
    assert got["problems"] == [], got
    assert got["api_types"] == (version >= "0.5.22")
    if version >= "0.5.23":  # WeightVersionSpan joined the contract in 0.5.23
        assert got["spans"] is True
    if got["api_types"]:
        assert {"/generate"} <= set(got["checked"]), got


@pytest.mark.parametrize("version", VERSIONS)
def test_sglangs_code_rejects_drift(version: str, recorded: tuple[list, list]) -> None:
    """The judge is SGLang's code, and it does reject what SGLang would reject."""
    r = reports(version, recorded)[1]
    assert r[0]["problems"] == []
    assert any("max_tokens" in p for p in r[2]["problems"]), r[2]  # SamplingParams: TypeError
    if version >= "0.5.22":  # the contract gate: a token id must be an int
        assert r[1]["problems"], r[1]
    assert r[3]["ignored"] == ["prompt_ids"], r[3]  # not a GenerateReqInput field: dropped
    assert any("serves" in p for p in r[4]["problems"]), r[4]
    assert r[5]["problems"], r[5]  # not a pause mode
    assert r[6]["problems"] and r[7]["problems"], (r[6], r[7])  # required fields missing
    assert r[8]["route"] is False
