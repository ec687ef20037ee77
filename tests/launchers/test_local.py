"""The local launcher: real child processes, deaths reported once, restart, stop by pid."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.launchers import Launcher, make_launcher
from asyncrl.launchers.base import TrainerArgs, trainer_command


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def _healthy(url: str, timeout_s: float = 120.0) -> None:
    client = SGLangClient(url, timeout_s=5.0)
    try:
        await client.wait_healthy(timeout_s)
    finally:
        await client.close()


def _deaths(launcher: Launcher, timeout_s: float = 30.0) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = launcher.deaths()
        if dead:
            return dead
        time.sleep(0.05)
    raise AssertionError(f"no death reported within {timeout_s}s")


async def test_engine_killed_is_reported_once_and_restarts_at_the_same_url(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = load_config(None, ["--rollout.num_engines=1"])
    launcher = make_launcher(cfg, tmp_path)
    assert isinstance(launcher, Launcher)
    assert launcher.advertise_host() == "127.0.0.1"
    try:
        (url,) = launcher.start_engines(str(tiny_model_dir))
        await _healthy(url)
        assert launcher.deaths() == []
        pid = launcher.processes()["engine0"].pid
        os.kill(pid, signal.SIGKILL)
        (death,) = _deaths(launcher)
        assert death.name == "engine0" and death.code == -signal.SIGKILL
        assert launcher.deaths() == []  # reported once
        assert "engine0" not in launcher.processes()
        assert launcher.restart("engine0") == url
        new_pid = launcher.processes()["engine0"].pid
        assert new_pid != pid
        await _healthy(url)
        with pytest.raises(ValueError, match="no process named"):
            launcher.restart("engine7")
    finally:
        await asyncio.to_thread(launcher.stop)
    assert not _alive(new_pid)
    assert launcher.deaths() == []  # exits caused by stop() are not deaths


def test_trainer_command_carries_the_advertised_addresses(tmp_path: Path) -> None:
    args = TrainerArgs(tmp_path / "c.json", "/m", 2, "tcp://10.0.0.1:5", ("http://10.0.0.2:1",))
    cmd = trainer_command(args, 1, "10.0.0.3", "10.0.0.4", 29500)
    flags = dict(zip(cmd[2::2], cmd[3::2], strict=False))
    assert cmd[:2] == ["-m", "asyncrl.engines.train.worker"]
    assert flags["--rank"] == "1" and flags["--world-size"] == "2"
    assert flags["--host"] == "10.0.0.3"
    assert (flags["--dist-addr"], flags["--dist-port"]) == ("10.0.0.4", "29500")
    assert flags["--batch-endpoint"] == "tcp://10.0.0.1:5"
    assert flags["--engine-urls"] == "http://10.0.0.2:1"
