"""The embedded engine answers only holders of the run secret, on every route, on loopback.

Against the session's engine server process (``engine_server``, started by the launcher
with the test session's secret through its pipe): each route of ``server.ROUTES`` with no
key, a wrong key, the right key under another scheme, or a key with a suffix gets 401 —
with bodies that would change the engine if they were served (pause, abort all, a new
version, a weight group, a generation) — and afterwards the weights (checksum), the served
version, the pause state, the queue (a request left running by the test) and the counters
are what they were.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from asyncrl import secret
from asyncrl.engines.rollout.base import EngineUnavailable
from asyncrl.engines.rollout.launcher import LaunchedServer
from asyncrl.engines.rollout.local.server import ROUTES
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.procs import free_port, python_env, stop

KEY = secret.load()
BAD_HEADERS: list[dict[str, str]] = [
    {},
    {"Authorization": "Bearer " + secret.generate()},
    {"Authorization": "Basic " + KEY},
    {"Authorization": "Bearer " + KEY + "x"},
    {"Authorization": "Bearer"},
]
BODIES: dict[str, Any] = {  # what each route would do, were it served
    "/generate": {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}},
    "/abort_request": {"abort_all": True},
    "/pause_generation": {"mode": "abort"},
    "/init_weights_update_group": {
        "master_address": "127.0.0.1",
        "master_port": free_port(),
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "intruder",
        "backend": "gloo",
    },
    "/update_weights_from_distributed": {
        "names": ["model.embed_tokens.weight"],
        "dtypes": ["float32"],
        "shapes": [[1]],
        "group_name": "intruder",
        "weight_version": "999",
    },
    "/update_weights_from_tensor": {"serialized_named_tensors": [], "weight_version": "999"},
    "/destroy_weights_update_group": {"group_name": "intruder"},
    "/update_weight_version": {"new_version": "999"},
}


async def _state(client: SGLangClient) -> dict[str, Any]:
    info = await client.get_server_info()
    http = client._http()  # the client's own session: it carries the key
    async with http.get(client.url + "/get_weights_checksum") as resp:
        assert resp.status == 200, await resp.text()
        checksum = await resp.json()
    return {
        "checksum": checksum,
        "version": await client.get_weight_version(),
        "paused": info["paused"],
        "num_requests": info["num_requests"],
        "counters": {k: v for k, v in info.items() if k.endswith(("aborted", "pauses"))},
    }


async def _idle(client: SGLangClient, timeout_s: float = 120.0) -> None:
    """Wait until the session's engine runs no request (an earlier test on this worker may
    have left requests running to their budget: they would end mid-test)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (await client.get_server_info())["num_requests"] > 0:
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"engine {client.url} still runs an earlier test's requests")
        await asyncio.sleep(0.05)


async def _running(
    client: SGLangClient, long: asyncio.Future | None = None, timeout_s: float = 60.0
) -> None:
    """Wait until the engine holds one request (the test's long generation)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (await client.get_server_info())["num_requests"] < 1:
        if long is not None and long.done():  # refused or failed: say why
            raise AssertionError(f"the test's request ended: {long.exception() or long.result()}")
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"engine {client.url} never took the test's request")
        await asyncio.sleep(0.05)


def test_every_route_refuses_without_the_key_and_changes_nothing(
    engine_server: LaunchedServer,
) -> None:
    async def main() -> None:
        client = SGLangClient(engine_server.url, timeout_s=60)
        await _idle(client)
        long = asyncio.ensure_future(  # a queue to keep: runs until the test aborts it
            client.generate([1, 2, 3], {"max_new_tokens": 100000, "ignore_eos": True}, rid="kept")
        )
        try:
            await _running(client, long)
            before = await _state(client)
            assert before["num_requests"] == 1 and not before["paused"]
            refused = []
            async with aiohttp.ClientSession() as raw:
                for method, path, _ in ROUTES:
                    for headers in BAD_HEADERS:
                        body = BODIES.get(path, {}) if method == "POST" else None
                        data = None if body is None else json.dumps(body)
                        url = engine_server.url + path
                        async with raw.request(method, url, data=data, headers=headers) as r:
                            assert r.status == 401, (method, path, headers, await r.text())
                            assert r.headers["WWW-Authenticate"] == "Bearer"
                            refused.append(path)
                async with raw.get(engine_server.url + "/no_such_route") as r:
                    assert r.status == 401  # unknown paths too: nothing is told without the key
            assert len(refused) == len(ROUTES) * len(BAD_HEADERS)
            assert await _state(client) == before
            assert not long.done()
            assert engine_server.log_path is not None
            log = engine_server.log_path.read_text()
            assert "without the run's key" in log and KEY not in log  # counted, never the key
        finally:
            await client.abort_request("kept")
            await asyncio.wait_for(asyncio.gather(long, return_exceptions=True), 30)
            await client.close()

    asyncio.run(main())


def test_the_key_opens_every_route_and_health(engine_server: LaunchedServer) -> None:
    """The same session's key under ``bearer`` (scheme is case-insensitive, as SGLang's and
    vLLM's servers) is served; the run's client sends it on its own."""

    async def main() -> None:
        async with aiohttp.ClientSession() as raw:
            headers = {"Authorization": "bearer " + KEY}
            async with raw.get(engine_server.url + "/health", headers=headers) as r:
                assert r.status == 200 and await r.text() == "ok"
        client = SGLangClient(engine_server.url, timeout_s=60)
        try:
            assert await client.health()
            out = await client.generate([1, 2, 3], {"max_new_tokens": 2, "ignore_eos": True})
            assert len(out.output_ids) == 2
        finally:
            await client.close()

    asyncio.run(main())


def test_a_client_with_another_secret_fails_fast_naming_the_fix(
    engine_server: LaunchedServer,
) -> None:
    """An engine started with another secret (``rollout.urls`` by hand): the health wait
    ends at the first 401 with what to do, not after the start-up timeout."""

    async def main() -> None:
        secret.use(secret.generate())  # this process, for one client: another run's secret
        try:
            client = SGLangClient(engine_server.url, timeout_s=10)
            client._http()  # its session (and headers) made now, under that secret
        finally:
            secret.use(KEY)
        t0 = asyncio.get_running_loop().time()
        try:
            with pytest.raises(EngineUnavailable, match=r"refused this process.s.*secret_file"):
                await client.wait_healthy(60)
        finally:
            await client.close()
        assert asyncio.get_running_loop().time() - t0 < 30

    asyncio.run(main())


def test_an_engine_started_by_hand_without_a_secret_makes_one_only_its_user_reads(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``asyncrl serve`` with no secret at all (no pipe, no ASYNCRL_SECRET(_FILE)): auth is
    still on; the key it made is in a 0600 file whose path (not the key) it logs."""
    port = free_port()
    env = {k: v for k, v in python_env().items() if not k.startswith("ASYNCRL_SECRET")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    cmd = [sys.executable, "-m", "asyncrl.entrypoints.engine", "--port", str(port)]
    cmd += ["--model-path", str(tiny_model_dir), "--threads", "1"]
    log = tmp_path / "engine.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        key_file = tmp_path / f"engine-{port}.secret"
        deadline = time.monotonic() + 120
        while not (key_file.is_file() and "no run secret given" in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert key_file.stat().st_mode & 0o777 == 0o600
        key = secret.read_file(key_file)
        assert key != KEY and key not in log.read_text() and str(key_file) in log.read_text()

        async def main() -> None:
            client = SGLangClient(f"http://127.0.0.1:{port}", timeout_s=10)
            try:  # this session's key is not that engine's
                with pytest.raises(EngineUnavailable, match="refused this process's run secret"):
                    await client.wait_healthy(100)
            finally:
                await client.close()
            url = f"http://127.0.0.1:{port}/get_model_info"
            async with aiohttp.ClientSession(headers=secret.auth_headers(key)) as http:
                async with http.get(url) as r:
                    assert r.status == 200

        asyncio.run(main())
    finally:
        stop([proc])
    assert proc.returncode == 0, log.read_text()[-2000:]  # SIGTERM: an orderly exit
    assert not key_file.exists()  # the key it made left with it (issue 37 item 10)


HOLDER = """
import argparse, json, os, sys
from asyncrl import secret
from asyncrl.entrypoints import engine
secret.use(sys.argv[1])  # as a child of the run's fork server holds it: no pipe, no variable
key, path = engine._secret(argparse.Namespace(secret_file="", port=4321))
print(json.dumps({"same": key == sys.argv[1], "path": str(path) if path else None}))
"""


def test_an_engine_that_holds_the_run_secret_writes_no_key_file(tmp_path: Path) -> None:
    """An engine forked by a run's fork server holds the run's secret already (the pipe was
    read by the server): it serves with it, writes no ``engine-PORT.secret`` and logs no
    "no run secret given" (it did both, with the run's own secret in that file)."""
    env = {k: v for k, v in python_env().items() if not k.startswith("ASYNCRL_SECRET")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    held = secret.generate()  # not this session's: it travels on the command line here
    out = subprocess.run([sys.executable, "-c", HOLDER, held], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"same": True, "path": None}
    assert "no run secret given" not in out.stderr and not list(tmp_path.iterdir())
