"""A benchmark killed from outside (SIGKILL, the OOM killer) leaves none of its processes
behind: the processes a bench starts die with it (``asyncrl.procs.spawn(...,
die_with_parent=True)``, or forked by a shared fork server that ends them when the bench's
connection closes); benches that run whole jobs get ``asyncrl run``'s guardian, tested by
``tests/bench/test_faults.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asyncrl.guard import proc_start_time
from asyncrl.procs import descendants, python_env, spawn, stop
from tests import runs

CMD = ["-m", "asyncrl.cli", "bench", "weight-sync", "--model=tiny", "--dtype=float32"]
CMD += ["--repeats=1000000", "--modes=overlap", "--no-naive"]


def _alive(started: dict[int, int]) -> list[int]:
    """The pids of ``started`` (pid -> start time) that still run as the same process."""
    return [p for p, t in started.items() if proc_start_time(p) == t and _not_zombie(p)]


def _not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_and_check(bench: Any, log: Path, children: Callable[[], set[int]]) -> None:
    """Wait for the bench's engine and the floor's peer (``children()``), SIGKILL the bench,
    and assert both are gone within seconds."""
    started: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 120
        while len(started) < 2:  # the engine and the floor's peer
            assert bench.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the bench started no engine and peer in 120 s"
            started = {p: proc_start_time(p) for p in children()}
            time.sleep(0.05)
        os.kill(bench.pid, signal.SIGKILL)
        bench.wait(10)
        deadline = time.monotonic() + 20
        while _alive(started) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(started), f"left behind: {_alive(started)} of {sorted(started)}"
    finally:
        stop([bench])
        for pid in _alive(started):  # only if the test failed: end them by pid
            os.kill(pid, signal.SIGKILL)


@pytest.mark.own_fork_server  # finds what is left of a bench among its descendants
@pytest.mark.timeout(150)
def test_a_sigkilled_benchmark_leaves_no_process_behind(tmp_path: Path) -> None:
    """weight-sync starts an engine and the floor's peer (fresh processes with
    ``die_with_parent``), then pushes (practically) forever; SIGKILLed there, both are gone
    within seconds."""
    bench = spawn(CMD, tmp_path / "bench.log", python_env())
    _kill_and_check(bench, tmp_path / "bench.log", lambda: set(descendants(bench.pid)))


@pytest.mark.timeout(150)
def test_a_sigkilled_benchmark_leaves_no_forked_process_behind(tmp_path: Path) -> None:
    """The same with a shared fork server (``ASYNCRL_FORK_SERVER``, the test session's):
    the engine and the peer are forked there, and end when the bench's connection closes."""
    if runs.shared_server_pid is None:
        pytest.skip("no shared fork server in this test session")
    # the server serves every test process: the bench's forks are those in its folder
    before = runs.forked_by_shared_server(tmp_path)
    with open(tmp_path / "bench.log", "ab") as log:  # the bench itself: fresh, in tmp_path
        bench = subprocess.Popen(
            [sys.executable, *CMD], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=python_env(), cwd=tmp_path, start_new_session=True,
        )  # fmt: skip
    forked = lambda: runs.forked_by_shared_server(tmp_path) - before  # noqa: E731
    _kill_and_check(bench, tmp_path / "bench.log", forked)
