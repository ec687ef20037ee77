"""5,000 hostile HTTP requests to a real engine server: every one answered, none with a 5xx,
and the engine generates exactly as before afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.bench.fuzz import greedy
from asyncrl.bench.fuzz_http import cases, send
from asyncrl.engines.rollout.base import GroupSpec
from asyncrl.engines.rollout.launcher import (
    LOCAL_SERVER,
    LaunchSpec,
    launch,
    stop_servers,
    wait_healthy,
)
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.procs import free_port
from asyncrl.secret import auth_headers
from tests.runs import spawn_shared


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    spec = LaunchSpec(
        str(tiny_model_dir), free_port(), extra_args=("--threads", "1"), module=LOCAL_SERVER
    )
    proc = launch(spec, tmp_path_factory.mktemp("engine") / "engine.log", spawner=spawn_shared)
    try:
        asyncio.run(wait_healthy([proc], timeout_s=120))
        yield proc.url
    finally:
        stop_servers([proc])


@pytest.mark.timeout(600)
def test_fuzz_5000_requests_no_5xx_all_answered_generation_unchanged(
    server: str, tiny_model_dir: Path
) -> None:
    import json

    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    before = asyncio.run(greedy(server))
    reqs = cases(5000, vocab, free_port(), seed=1)
    out = asyncio.run(send(server, reqs, concurrency=32, timeout_s=120))
    assert out["sent"] == 5000
    assert out["5xx"] == 0, out
    assert out["unanswered"] == 0, out
    assert out["by_status"].get("400", 0) > 2500, out  # mostly refused, with a reason
    assert asyncio.run(greedy(server)) == before


GROUP = {
    "master_address": "127.0.0.1",
    "master_port": 29500,
    "rank_offset": 1,
    "world_size": 2,
    "timeout_s": 1,
}
BUCKET = {
    "names": ["model.norm.weight"],
    "dtypes": ["float32"],
    "group_name": "g",
    "asyncrl_bucket": {"index": 0, "count": 1, "version": 1},
}


def _bucket(**fields: object) -> dict:
    """A 256 B bucket (model.norm.weight) announced with ``fields`` added to its manifest."""
    return {**BUCKET, "shapes": [[64]], "asyncrl_bucket": {**BUCKET["asyncrl_bucket"], **fields}}


@pytest.mark.parametrize(
    ("path", "raw", "reason"),
    [
        ("/generate", b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1e400}}', "max_"),
        ("/generate", b'{"a":' * 1000 + b"1" + b"}" * 1000, "not JSON"),
        ("/generate", b"[" * 100_000 + b"]" * 100_000, "not JSON"),
        ("/init_weights_update_group", {**GROUP, "master_port": 99999}, "master_port"),
        ("/init_weights_update_group", {**GROUP, "master_address": "8.8.8.8"}, "not an allowed"),
        ("/init_weights_update_group", {**GROUP, "master_address": "0.0.0.0"}, "not an allowed"),
        ("/update_weights_from_distributed", {**BUCKET, "shapes": [[-4]]}, "bad size"),
        ("/update_weights_from_distributed", {**BUCKET, "shapes": [[1 << 40]]}, "larger than"),
        ("/update_weights_from_distributed", _bucket(verify="most"), "verify must be one of"),
        ("/update_weights_from_distributed", _bucket(delta=[0, 1 << 40, None]), "nbytes must"),
        ("/update_weights_from_distributed", _bucket(delta=[0, 13, None]), "12 * words"),
        ("/update_weights_from_distributed", _bucket(delta=[0, 12, "x"]), "checksum must"),
        ("/abort_request", {"abort_all": "false"}, "abort_all"),
        ("/update_weight_version", {"new_version": [1]}, "new_version"),
    ],
)
def test_client_mistakes_get_400_with_the_reason(
    server: str, path: str, raw: bytes | dict, reason: str
) -> None:
    import json

    async def post() -> tuple[int, dict]:
        import aiohttp

        data = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
        async with (
            aiohttp.ClientSession(headers=auth_headers()) as http,
            http.post(server + path, data=data) as r,
        ):
            return r.status, await r.json(content_type=None)

    status, out = asyncio.run(post())
    assert status == 400 and reason in out["error"]["message"], (status, out)


def test_non_object_bucket_field_gets_400(server: str) -> None:
    """Needs a group to reach the bucket: join one at loopback with the test as rank 0."""
    from asyncrl.transports.weights.collective_wire import new_weight_group

    port = free_port()

    async def go() -> tuple[int, dict]:
        import aiohttp

        client = SGLangClient(server)
        try:
            own = asyncio.to_thread(new_weight_group, "gloo", "127.0.0.1", port, 0, 2, "g", 30)
            call = client.init_weights_update_group(GroupSpec("127.0.0.1", port, 1, 2, "g", "gloo"))
            await asyncio.gather(own, call)
        finally:
            await client.close()
        body = {**BUCKET, "shapes": [[64]], "asyncrl_bucket": [1, 2]}
        async with aiohttp.ClientSession(headers=auth_headers()) as http:
            async with http.post(server + "/update_weights_from_distributed", json=body) as r:
                return r.status, await r.json(content_type=None)

    status, out = asyncio.run(go())
    assert status == 400 and "asyncrl_bucket must be an object" in out["error"]["message"], out
