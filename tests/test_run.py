"""End to end: `asyncrl run` through every process (engine, trainer, controller)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl import secret
from asyncrl.config.run import ExperienceConfig
from asyncrl.procs import pid_alive, python_env
from tests.launchers.cluster import descendants, listeners, listening
from tests.runs import leaks

pytestmark = pytest.mark.own_fork_server  # reads the run's process tree and its own fork server

_SHORT_RUN = (
    "--controller.total_steps=6",
    "--controller.batch_size=4",
    "--controller.max_staleness=1",
)


def _run_cli(tmp_path: Path, model_dir: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "--run-dir", str(tmp_path / "run")]
    cmd += [f"--model.path={model_dir}", "--quiet", *extra]
    return subprocess.Popen(cmd, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_short_run_end_to_end(tmp_path: Path, tiny_model_dir: Path) -> None:
    proc = _run_cli(tmp_path, tiny_model_dir, *_SHORT_RUN)
    _check_finished_run(tmp_path, proc, steps=6)


@pytest.mark.gpu
def test_short_run_on_cuda_with_cuda_ipc(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Trainer (FSDP2/NCCL) and engine colocated on one GPU, weights over CUDA IPC."""
    proc = _run_cli(
        tmp_path,
        tiny_model_dir,
        *_SHORT_RUN,
        "--trainer.device=cuda",
        "--rollout.device=cuda",
        "--weights.backend=cuda-ipc",
    )
    # cluster.fork_server=auto starts none when a process of the run uses CUDA (a forked CUDA
    # context is unusable): the trainer and the engine are fresh interpreters
    _check_finished_run(tmp_path, proc, steps=6, forked=False)


def _check_finished_run(
    tmp_path: Path, proc: subprocess.Popen, steps: int, forked: bool = True
) -> None:
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    for r in rows:
        assert {"reward_mean", "staleness_max", "weight_version", "num_samples", "wall_s"} <= set(r)
        assert 0 <= r["staleness_max"] <= 1
        assert r["num_samples"] == 4 * 8
    if Path("/proc/self/stat").is_file():  # CPU seconds per process, monotone over the run
        keys = ("cpu_controller_s", "cpu_engine0_s", "cpu_trainer0_s")
        assert all(r[k] >= 0.0 for r in rows for k in keys)
        assert all(rows[-1][k] >= rows[0][k] for k in keys)
    versions = {r["weight_version"] for r in rows}
    assert len(versions) >= 3 and max(versions) == steps
    pids = json.loads((run / "processes.json").read_text())
    # cluster.fork_server=auto: a fork server on a CPU, none where CUDA is used
    assert set(pids) == {"engine0", "trainer0"} | ({"forkserver"} if forked else set())
    assert not [name for name, pid in pids.items() if pid_alive(pid)]
    # the run secret (this session's: the run read ASYNCRL_SECRET_FILE) is in no file of the
    # run folder: logs, config.json, processes.json, metrics, trace, checkpoints
    assert (run / "trace.json").is_file() and list(run.glob("*.log"))
    assert leaks(secret.load(), run, []) == []
    for name in ("engine0", "trainer0"):  # forks of the fork server run as python -m would
        assert "RuntimeWarning" not in (run / f"{name}.log").read_text(), name
    # each process logs its start-up milestones, timed from its own start (where a slow start went)
    said = (run / "trainer0.log").read_text() + (run / "engine0.log").read_text()
    for line in (
        r"rank 0 start-up: process group on \S+ joined [\d.]+ s after the process started",
        r"rank 0 start-up: model, optimizer and experience channel ready [\d.]+ s after",
        r"engine INFO start-up: model loaded on \S+ [\d.]+ s after the process started",
    ):
        assert re.search(line, said), line


def test_sigint_stops_every_process_and_nothing_listened_beyond_loopback(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A default run mid-way (after two steps: trainer rendezvous, weight group, engine HTTP,
    experience channel all up): every socket any of its processes listens on is bound to
    127.0.0.1, the configured address (never ``*`` / ``::``); the run secret is in no
    process's command line or environment (engine, trainer, guard, controller) nor in any file
    of the run folder, then or after; then SIGINT ends them all."""
    proc = _run_cli(tmp_path, tiny_model_dir, "--controller.total_steps=10000")
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        pids = json.loads((tmp_path / "run" / "processes.json").read_text())
        table = listeners()
        bound = set().union(*(listening(p, table) for p in descendants(proc.pid)))
        assert len(bound) >= 3, bound  # engine HTTP, experience ROUTER, trainer and weight stores
        assert {addr for addr, _ in bound} == {"127.0.0.1"}, bound
        running = [proc.pid, *descendants(proc.pid)]
        assert set(pids.values()) <= set(running)
        assert leaks(secret.load(), tmp_path / "run", running) == []
        reported = len(metrics.read_text().splitlines())
        proc.send_signal(signal.SIGINT)
        # a hang guard only (load-independent checks below): the stop trains what the
        # trainer holds, checkpoints it and ends every process
        out, _ = proc.communicate(timeout=180)
        text = out.decode(errors="replace")
        assert proc.returncode == 130, text
        stopped = re.search(r"checkpoint of step (\d+) written", text)
        assert stopped is not None, text
        step = int(stopped.group(1))  # every batch sent before the signal, and no more:
        assert reported <= step <= reported + 2 * ExperienceConfig().credits, (reported, text)
        assert (tmp_path / "run" / "checkpoints" / f"step-{step}").is_dir()
        assert not [name for name, pid in pids.items() if pid_alive(pid)]
        assert leaks(secret.load(), tmp_path / "run", []) == []  # checkpoint on SIGINT included
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigint_while_waiting_for_rollout_urls_stops_the_run(
    tmp_path: Path, tiny_model_dir: Path, free_port: int
) -> None:
    """Ctrl-C while the run waits (``rollout.startup_timeout_s=300``) for a ``rollout.urls``
    engine that nothing serves: exit 130 with the stop said, not after the wait (the first
    signal used to set only the stop event, which that wait did not watch)."""
    url = f"--rollout.urls=http://127.0.0.1:{free_port}"
    proc = _run_cli(tmp_path, tiny_model_dir, url, "--rollout.startup_timeout_s=300")
    guard = tmp_path / "run" / "pids.json"  # written by the run's loop: its handlers are set
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not guard.is_file():
            time.sleep(0.05)
        assert guard.is_file(), proc.stdout.read().decode() if proc.stdout else ""
        guarded = json.loads(guard.read_text())  # {name: [pid, start time]}: its fork server
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)  # a hang guard, well under the 300 s wait
        text = out.decode(errors="replace")
        assert proc.returncode == 130, text
        assert "Traceback" not in text and "before the first step" in text, text
        assert not (tmp_path / "run" / "processes.json").exists()  # no trainer was started
        assert not [name for name, (pid, _) in guarded.items() if pid_alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigint_while_starting_exits_at_once_leaving_no_process(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Ctrl-C right after the engine and trainer were spawned (still loading): no
    checkpoint to wait for, exit 130 within seconds, no traceback, every child ended."""
    proc = _run_cli(tmp_path, tiny_model_dir, "--controller.total_steps=10000")
    pids_file = tmp_path / "run" / "processes.json"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not pids_file.is_file():
            time.sleep(0.05)
        assert pids_file.is_file(), proc.stdout.read().decode() if proc.stdout else ""
        pids = json.loads(pids_file.read_text())
        assert set(pids) == {"engine0", "trainer0", "forkserver"}
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)  # a hang guard (stop()'s SIGTERM grace is 5 s)
        text = out.decode(errors="replace")
        assert proc.returncode == 130, text
        # not waiting for a step: nothing trained, nothing to checkpoint
        assert "Traceback" not in text and "before the first step" in text
        assert not (tmp_path / "run" / "checkpoints").exists() or not any(
            (tmp_path / "run" / "checkpoints").iterdir()
        )
        assert not [name for name, pid in pids.items() if pid_alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
