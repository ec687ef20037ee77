"""Helpers for tests that drive a real `asyncrl run`: its metrics rows, waits on them, kills."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncrl import forkserver
from asyncrl.controllers.checkpoints import latest_checkpoint
from asyncrl.procs import Proc, descendants, finish, free_port, pid_alive, python_env, stop

MARK = "ASYNCRL_TEST_MARK"
"""Environment variable a test sets on a run: every process the run starts inherits it."""


shared_server_pid: int | None = None
"""The test session's shared fork server (tests/conftest.py), while it runs."""


def forked_by_shared_server(cwd: Path) -> set[int]:
    """Live processes the shared fork server forked for clients working in ``cwd`` (and
    what those started), empty without a server. The server serves every test process of
    the session, and forks each child in its client's working directory (the request's
    ``cwd``; nothing of asyncrl changes directory after): a test that starts its run or
    bench in a folder of its own tells that run's forks from other tests' by it."""
    pid = shared_server_pid
    if pid is None:
        return set()
    return {p for p in descendants(pid) if p != pid and _works_in(p, cwd)}


def _works_in(pid: int, folder: Path) -> bool:
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd")).is_relative_to(folder)
    except OSError:  # gone meanwhile (a zombie has no working directory: it has ended)
        return False


def spawn_shared(args: list[str], log: Path, env: dict[str, str]) -> Proc:
    """Start ``python ARGS`` (``-m MODULE ...``) forked from the test session's shared fork
    server when there is one (tests/conftest.py; :func:`asyncrl.forkserver.spawn_shared`):
    a stand-in server then skips importing torch. Its own session, log, environment
    (``PYTHONPATH`` first on its path); stopped by pid like any other."""
    return forkserver.spawn_shared(args, log, env)


@contextlib.contextmanager
def engine_server(model_dir: Path, log: Path, **engine_args: Any) -> Iterator[str]:
    """An embedded engine server process on ``model_dir`` (forked by :func:`spawn_shared`,
    ``engine_args`` as :func:`tests.inproc.inproc_engine`'s, given as its options: ``seed=1``
    is ``--seed 1``); its URL once it is healthy. Stopped on exit."""
    from asyncrl.engines.rollout.sglang import SGLangClient

    port = free_port()
    args = ["-m", "asyncrl.entrypoints.engine", "--model-path", str(model_dir)]
    for key, value in engine_args.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    proc = spawn_shared([*args, "--port", str(port)], log, python_env())
    url = f"http://127.0.0.1:{port}"
    try:

        async def up() -> None:
            c = SGLangClient(url)
            try:
                await c.wait_healthy(120)
            finally:
                await c.close()

        asyncio.run(up())
        yield url
    finally:
        stop([proc])


def marked_pids(mark: str) -> list[int]:
    """Live processes whose environment holds ``ASYNCRL_TEST_MARK=mark`` (Linux /proc): what
    is left of a run started with that mark, its children in their own sessions included."""
    needle = f"{MARK}={mark}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and d.name != str(os.getpid()):
            try:
                env = (d / "environ").read_bytes().split(b"\0")
            except OSError:  # gone meanwhile, or not ours to read
                continue
            if needle in env and pid_alive(int(d.name)):
                pids.append(int(d.name))
    return pids


def metrics_rows(run: Path) -> list[dict]:
    """The run's metrics rows so far (``metrics.jsonl``), one dict per line."""
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln]


def _count(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def wait_rows(run: Path, proc: subprocess.Popen, n: int, timeout_s: float = 240) -> None:
    """Poll until the run has logged ``n`` metrics rows; AssertionError with its output if it
    exits first or ``timeout_s`` passes (the process is then ended)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if _count(run) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {n} metrics rows (rc {proc.poll()}): {finish(proc, 5)[1][-3000:]}")


def wait_checkpoint(run: Path, proc: subprocess.Popen, timeout_s: float = 120) -> int:
    """Poll until the run has a complete checkpoint (a loaded machine writes it steps after
    it is asked for); returns its step. AssertionError with the run's output if it exits
    first or ``timeout_s`` passes (the process is then ended)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if (found := latest_checkpoint(run)) is not None:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no complete checkpoint (rc {proc.poll()}): {finish(proc, 5)[1][-3000:]}")


def kill_when_rows(
    proc: subprocess.Popen,
    run: Path,
    name: str,
    after_rows: int,
    timeout_s: float = 300,
    checkpointed: bool = False,
) -> tuple[dict[str, int], int, str]:
    """SIGKILL the run's process ``name`` (from ``processes.json``) once ``after_rows`` metrics
    rows are logged (and, with ``checkpointed``, a checkpoint is complete), then wait for the
    run to end within ``timeout_s`` in all.

    Returns (the run's pids as read at the kill, its return code, its output).
    AssertionError if the run ended before the kill; the run is killed if it outlives
    the deadline.
    """
    deadline, pids = time.monotonic() + timeout_s, {}
    try:
        while proc.poll() is None and time.monotonic() < deadline and not pids:
            ready = not checkpointed or latest_checkpoint(run) is not None
            if ready and _count(run) >= after_rows:
                pids = json.loads((run / "processes.json").read_text())
                os.kill(pids[name], signal.SIGKILL)
            time.sleep(0.05)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    rc, out = finish(proc, max(1.0, deadline - time.monotonic()))
    assert pids, f"the run ended before {name} could be killed: {out[-3000:]}"
    return pids, rc, out


def secret_forms(key: str) -> list[bytes]:
    """The run secret and what is derived from it that must stay as private (its CURVE
    secret keys), as bytes to look for."""
    from asyncrl.secret import curve_keys

    _, server_secret, _, client_secret = curve_keys(key)
    return [key.encode(), server_secret, client_secret]


def leaks(key: str, run_dir: Path, pids: list[int]) -> list[str]:
    """Where the run secret (:func:`secret_forms`) shows: any file under ``run_dir`` (logs,
    config.json, processes.json, metrics, trace, checkpoints: every byte), and the
    ``/proc/PID/cmdline`` and ``/proc/PID/environ`` of each of ``pids`` still alive."""
    forms = secret_forms(key)
    found = []
    for f in sorted(run_dir.rglob("*")):
        if f.is_file() and any(x in f.read_bytes() for x in forms):
            found.append(str(f))
    for pid in pids:
        for part in ("cmdline", "environ"):
            try:
                data = Path(f"/proc/{pid}/{part}").read_bytes()
            except OSError:  # gone meanwhile
                continue
            if any(x in data for x in forms):
                found.append(f"/proc/{pid}/{part}")
    return found
