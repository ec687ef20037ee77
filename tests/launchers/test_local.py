"""The local launcher: real child processes, deaths reported once, restart, stop by pid."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.forkserver import Forked
from asyncrl.launchers import Launcher, make_launcher
from asyncrl.launchers.base import TrainerArgs, trainer_command
from asyncrl.launchers.local import LocalLauncher
from asyncrl.procs import pid_alive, python_env
from asyncrl.transports.experience.shm import PREFIX, SHM_DIR
from tests.runs import kill_when_rows


async def _healthy(url: str, timeout_s: float = 120.0) -> None:
    client = SGLangClient(url, timeout_s=5.0)
    try:
        await client.wait_healthy(timeout_s)
    finally:
        await client.close()


def _deaths(launcher: Launcher, timeout_s: float = 120.0) -> list:
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
    assert not pid_alive(new_pid)
    assert launcher.deaths() == []  # exits caused by stop() are not deaths


@pytest.mark.parametrize(("backend", "forked"), [("local", True), ("sglang", False)])
def test_the_fork_server_starts_embedded_engines_and_never_another_program(
    tiny_model_dir: Path, tmp_path: Path, backend: str, forked: bool
) -> None:
    """With the fork server on, an embedded engine is its fork; an SGLang server (started
    behind asyncrl.entrypoints.keyed, a ``-m`` command too) is a fresh process, as on Ray.
    No SGLang here: that server ends at once, which is all this test needs of it."""
    cfg = load_config(None, [f"--rollout.backend={backend}", "--cluster.fork_server=on"])
    launcher = make_launcher(cfg, tmp_path)
    assert isinstance(launcher, LocalLauncher)
    try:
        launcher.start_engines(str(tiny_model_dir))
        proc = launcher.procs["engine0"]
        assert launcher.fork_server is not None and launcher.fork_server.alive()
        assert isinstance(proc, Forked) is forked
        assert isinstance(proc, subprocess.Popen) is not forked  # a child of this process
        if not forked:
            assert proc.args[1:3] == ["-m", "asyncrl.entrypoints.keyed"]
    finally:
        launcher.stop()


def test_trainer_command_carries_the_advertised_addresses(tmp_path: Path) -> None:
    args = TrainerArgs(tmp_path / "c.json", "/m", 2, "tcp://10.0.0.1:5", ("http://10.0.0.2:1",))
    cmd = trainer_command(args, 1, "10.0.0.3", "10.0.0.4", 29500)
    flags = dict(zip(cmd[2::2], cmd[3::2], strict=False))
    assert cmd[:2] == ["-m", "asyncrl.entrypoints.trainer"]
    assert flags["--rank"] == "1" and flags["--world-size"] == "2"
    assert flags["--host"] == "10.0.0.3"
    assert (flags["--dist-addr"], flags["--dist-port"]) == ("10.0.0.4", "29500")
    assert flags["--batch-endpoint"] == "tcp://10.0.0.1:5"
    assert flags["--engine-urls"] == "http://10.0.0.2:1"


def test_engine_killed_mid_run_is_restarted_resynced_and_the_run_finishes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    steps = 14
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--run-dir", str(run)]
    cmd += [f"--model.path={tiny_model_dir}", "--quiet", f"--controller.total_steps={steps}"]
    cmd += ["--controller.batch_size=4"]
    out = _kill_engine_mid_run(cmd, python_env(), run, after_rows=3)
    assert "engine0 exited with -9; restart 1 of 3" in out, out
    assert "back in rotation at weight version" in out, out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["staleness_max"] <= 1 for r in rows)
    assert rows[-1]["ctl_engines_out"] == 0  # back in rotation
    assert rows[-1]["ctl_failed"] == 0 and " failed: " not in out  # the outage lost no group


def test_no_engine_left_stops_the_run_with_an_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The only engine dies with no restart allowed: the run stops, saying so, and leaves
    no process behind."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--run-dir", str(run), "--quiet"]
    cmd += [f"--model.path={tiny_model_dir}", "--controller.total_steps=40"]
    cmd += ["--controller.batch_size=4", "--rollout.max_restarts=0"]
    proc = subprocess.Popen(cmd, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pids, rc, text = kill_when_rows(proc, run, "engine0", after_rows=2, timeout_s=120)
    assert rc == 1, text
    assert "no rollout engine left (each died more than rollout.max_restarts=0 times)" in text
    assert "engine0: engine0 exited with -9" in text, text
    assert not [p for p in pids.values() if pid_alive(p)], pids
    # a failed run removes its experience rings too (the producer is the run's process)
    assert not list(SHM_DIR.glob(f"{PREFIX}{proc.pid}-*")), "a failed run left its shm ring"


def _kill_engine_mid_run(cmd: list[str], env: dict[str, str], run: Path, after_rows: int) -> str:
    """Start ``asyncrl run``, SIGKILL engine0 once ``after_rows`` steps are logged, wait for
    the end; its output (asserting it exited 0 and the engine came back as a new process)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pids, rc, text = kill_when_rows(proc, run, "engine0", after_rows)
    assert rc == 0, text
    assert not pid_alive(pids["engine0"])
    return text


def test_engine_leaving_for_good_does_not_stall_the_weight_push(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """One of two engines dies with no restart allowed while the other stays: the run goes on
    with the engine left, and no push waits for the dead one (``weights.timeout_s`` is 600 s
    here: a push that waited for it would hold the next steps' rows back that long; the
    test waits at most half that, a hang guard, not a budget of a quiet machine)."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--run-dir", str(run), "--quiet"]
    cmd += [f"--model.path={tiny_model_dir}", "--controller.total_steps=200"]
    cmd += ["--controller.batch_size=4", "--rollout.num_engines=2", "--rollout.max_restarts=0"]
    cmd += ["--weights.timeout_s=600", "--checkpoint.every_steps=0"]
    metrics = run / "metrics.jsonl"
    proc = subprocess.Popen(cmd, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pids: dict[str, int] = {}
    try:
        deadline, killed, before = time.monotonic() + 180, 0.0, 0
        while proc.poll() is None and time.monotonic() < deadline and not killed:
            rows = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
            if rows >= 2:
                pids = json.loads((run / "processes.json").read_text())
                os.kill(pids["engine1"], signal.SIGKILL)
                killed, before = time.monotonic(), rows
            time.sleep(0.05)
        assert killed, "the run ended or stalled before the engine could be killed"
        # 4 more steps trained and pushed with the engine left: well before weights.timeout_s
        deadline = killed + 300
        while proc.poll() is None and time.monotonic() < deadline:
            rows = metrics.read_text().splitlines()
            if len(rows) >= before + 4:
                break
            time.sleep(0.05)
        after = [json.loads(line) for line in metrics.read_text().splitlines()[before:]]
        took = time.monotonic() - killed
        assert proc.poll() is None, "the run ended"
        assert len(after) >= 4, f"{len(after)} step(s) in {took:.1f}s after engine1 left"
        pushes = [r["sync_s"] for r in after if "sync_s" in r]
        assert max(pushes, default=0.0) < 300, pushes  # none waited out weights.timeout_s
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.decode(errors="replace")
    assert "engine1 exited with -9 after 0 restarts: out of the run; 1 engine(s) left" in text
    assert not [p for p in pids.values() if pid_alive(p)], pids


def test_a_trainer_failure_past_its_budget_fails_the_run_and_leaves_no_ring(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``trainer.max_restarts=0``: the trainer's death ends the run (exit 1, naming the
    budget), and that failed exit removes the run's shared-memory rings like a clean one
    (a soak left a ring behind on exactly this path)."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--run-dir", str(run), "--quiet"]
    cmd += [f"--model.path={tiny_model_dir}", "--controller.total_steps=40"]
    cmd += ["--controller.batch_size=4", "--trainer.max_restarts=0"]
    proc = subprocess.Popen(cmd, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    rings: list[Path] = []
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and not rings:
            assert time.monotonic() < deadline, "no ring and no 2 steps in 120 s"
            if _rows(run) >= 2:
                rings = list(SHM_DIR.glob(f"{PREFIX}{proc.pid}-*"))
            time.sleep(0.05)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    assert rings, "the run made no shared-memory ring (experience.shm=auto, one host)"
    pids, rc, text = kill_when_rows(proc, run, "trainer0", after_rows=2, timeout_s=120)
    assert rc == 1, text
    assert "trainer.max_restarts=0 per trainer.restart_window_s=600 used up" in text, text
    assert not [p for p in pids.values() if pid_alive(p)], pids
    assert not [r for r in rings if r.exists()], "a failed run left its shm ring"


def _rows(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0
