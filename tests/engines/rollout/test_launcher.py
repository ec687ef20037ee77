"""The launcher: command line of SGLang servers; start, health-wait and stop by pid for real
(through the embedded server, which takes SGLang's flags); engines given by URL."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from asyncrl.config import SGLangRolloutConfig
from asyncrl.engines.rollout.base import EngineUnavailable, poll_healthy
from asyncrl.engines.rollout.launcher import (
    LOCAL_SERVER,
    LaunchSpec,
    launch,
    launch_command,
    start_engines,
    stop_servers,
    wait_healthy,
)


def test_sglang_command_line() -> None:
    spec = LaunchSpec("/models/qwen", 31000, "0.0.0.0", 2, 0.7, ("--skip-tokenizer-init",))
    assert launch_command(spec) == [
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/qwen",
        "--tp-size",
        "2",
        "--host",
        "0.0.0.0",
        "--port",
        "31000",
        "--mem-fraction-static",
        "0.7",
        "--skip-tokenizer-init",
    ]
    assert spec.url == "http://127.0.0.1:31000"
    with pytest.raises(ValueError, match="mem_fraction_static"):
        launch_command(LaunchSpec("/m", 1, mem_fraction_static=1.5))
    with pytest.raises(ValueError, match="tp_size"):
        launch_command(LaunchSpec("/m", 1, tp_size=0))


def test_engines_given_by_url_are_taken_as_they_are(tmp_path: Path) -> None:
    rc = SGLangRolloutConfig(urls=("http://10.0.0.1:30000", "http://10.0.0.2:30000"))
    urls, servers = start_engines(rc, "/models/x", tmp_path)
    assert urls == list(rc.urls) and servers == []


async def test_the_health_wait_polls_soon_then_every_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server about to answer (a run's forked engine: ~0.1 s) is seen within a few ms of
    answering; a slow one is polled every ``interval_s``, and the wait still gives up."""
    pauses: list[float] = []
    answers = iter(["refused"] * 8 + [None])

    async def sleep(s: float) -> None:
        pauses.append(s)

    async def why() -> str | None:
        return next(answers)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    await poll_healthy("http://e", why, timeout_s=60, interval_s=0.2)
    assert pauses == [0.01, 0.02, 0.04, 0.08, 0.16, 0.2, 0.2, 0.2]

    async def never() -> str:
        return "refused"

    pauses.clear()
    with pytest.raises(EngineUnavailable, match=r"did not answer within -1s \(last: refused\)"):
        await poll_healthy("http://e", never, timeout_s=-1, interval_s=0.005)
    assert pauses == []  # past the deadline at the first failure: no pause


async def test_launch_wait_and_stop_by_pid(tiny_model_dir: Path, tmp_path: Path, free_port: int):
    spec = LaunchSpec(
        str(tiny_model_dir), free_port, module=LOCAL_SERVER, extra_args=("--threads", "1")
    )
    server = launch(spec, tmp_path / "engine.log")
    try:
        with pytest.raises(EngineUnavailable, match=r"did not answer within 0\.01s"):
            await wait_healthy([server], timeout_s=0.01)
        await wait_healthy([server], timeout_s=120)
        assert server.proc.poll() is None
    finally:
        stop_servers([server])
    assert server.proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(server.pid, 0)


async def test_a_server_that_dies_fails_the_wait_with_its_log(tmp_path: Path, free_port: int):
    spec = LaunchSpec(str(tmp_path / "no-model"), free_port, module=LOCAL_SERVER, tp_size=2)
    server = launch(spec, tmp_path / "engine.log")
    try:
        with pytest.raises(EngineUnavailable, match=r"(?s)exited with 1.*tp-size must be 1"):
            await asyncio.wait_for(wait_healthy([server], timeout_s=120), 120)
    finally:
        stop_servers([server])
