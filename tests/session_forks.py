"""Fork servers shared by the whole test session, one per environment that upstream code
needs (vLLM 0.33's server code, each SGLang version's source: ``tests/engines/rollout/
{vllm,sglang}/``), for the test servers, receiving ranks and probes that import it; and
one for asyncrl's own trainers and engines (``shared_fork_server`` in tests/conftest.py,
started by the session's main process at ``pytest_configure``: :meth:`SessionForkServer.started`).

Importing vLLM's CLI or an SGLang version's server modules costs 3-6 CPU-s (torch's
inductor, transformers, openai's types), paid by each of the ~50 such processes a suite
starts; forked from a server that imported them once, a start costs a fork. The server
is an :mod:`asyncrl.entrypoints.forkserver` started with that environment (its source
first on the path, as a fresh process of that kind has it) by the first test process that
needs it (:meth:`SessionForkServer.socket_path`; a session that needs none pays nothing),
under a file lock in the session's temporary folder that every pytest-xdist worker shares,
so the workers share one server per environment. It ends with the session's main pytest
process, however it ends (``--exit-with``: the xdist controller, or pytest itself without
xdist), killing what it forked; a worker that dies takes the processes it had forked with
it (its connection closes). Each forked process gets the environment it was given, its
own session and log (:func:`asyncrl.forkserver.spawn_shared`). Where no server was
allowed (:func:`allow`: the session fixture in tests/conftest.py; a process the tests
started finds the folder in ``ENV``), a start is what it was without one.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.forkserver import ENV_SHARED, spawn_shared
from asyncrl.procs import python_env, stop

__all__ = [
    "ENV", "SessionForkServer", "allow", "as_imported", "children", "preload", "stop_all",
]  # fmt: skip

ENV = "ASYNCRL_TEST_SESSION_FORKS"
"""``FOLDER:PID``: the session's fork servers' folder and the process they end with."""


IMPORT_ENV: dict[str, str] = {}
"""In a fork server (and so in what it forks): the environment variables its preloaded
modules set at import time (vLLM's ``env_override`` sets ``TORCHINDUCTOR_COMPILE_THREADS``,
...); empty in a fresh interpreter."""


def preload(modules: tuple[str, ...], optional: bool = False) -> None:
    """A server's preload module calls this: import ``modules`` (``optional``: those that
    cannot import here are left to the forked process, which fails on them as a fresh one
    would), noting what they set in the environment (``IMPORT_ENV``)."""
    import importlib

    before = dict(os.environ)
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            if not optional:
                raise
    IMPORT_ENV.update({k: v for k, v in os.environ.items() if before.get(k) != v})


def as_imported() -> None:
    """In a forked process's main: set what the server's imports set in the environment
    (``IMPORT_ENV``) where its own environment does not, as those imports would have in a
    fresh interpreter (a fork has the modules imported, with the environment it was given);
    nothing in a fresh interpreter."""
    for key, value in IMPORT_ENV.items():
        os.environ.setdefault(key, value)


def allow(folder: Path, owner: int) -> None:
    """Let this process (and those it starts) start the session's servers in ``folder``,
    each ending with process ``owner`` (module docstring)."""
    os.environ[ENV] = f"{folder}:{owner}"


def stop_all(folder: Path, timeout_s: float = 10.0) -> None:
    """End the servers started in ``folder`` (SIGTERM: each kills what it forked) and wait
    for them to go; the session's main process calls this at its end, so that none
    outlives it even briefly (``--exit-with`` ends them anyway, a moment later)."""
    import signal

    pids = [int(f.read_text()) for f in folder.glob("*.pid") if f.read_text().isdigit()]
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    for proc in _started:  # reaped: their CPU time (and their reaped forks') is this process's
        if proc.pid in pids:  # children's, as `/usr/bin/time pytest` reports it
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass


def _room() -> tuple[Path, int] | None:
    folder, _, owner = os.environ.get(ENV, "").rpartition(":")
    return (Path(folder), int(owner)) if folder and owner.isdigit() else None


def children(server: int) -> dict[int, str]:
    """The live processes ``server`` forked: pid -> command line."""
    out: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == server:
                out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):  # not a process, or gone meanwhile
            continue
    return out


class SessionForkServer:
    """The session's fork server named ``name``: ``env()`` its environment (``PYTHONPATH``
    first), ``preload`` what it imports before it forks."""

    def __init__(self, name: str, env: Callable[[], dict[str, str]], preload: tuple[str, ...]):
        self.name, self.env, self.preload = name, env, preload
        self._lock = threading.Lock()

    def socket_path(self) -> str | None:
        """The server's socket, started now if there is none yet (waiting until it listens);
        None where none may be started, or it does not run."""
        got = self._ensure(wait=True)
        if got is None:
            return None
        sock, pid = got
        return sock if Path(sock).exists() and _alive(pid) else None

    def started(self) -> tuple[str, int] | None:
        """The server's socket path and pid, the server started now if no test process
        started it yet, without waiting for its imports (a client that comes before it
        listens starts its processes afresh: :func:`asyncrl.forkserver.spawn_shared`);
        None where none may be started."""
        return self._ensure(wait=False)

    def wait_listening(self, timeout_s: float) -> bool:
        """Whether the server listens, waiting up to ``timeout_s`` while it imports (False:
        it ended, or still imports; its clients then start their processes afresh)."""
        deadline = time.monotonic() + timeout_s
        while True:
            room, pid = _room(), self.server_pid()
            if room is None or pid is None:
                return False
            if (room[0] / f"{self.name}.sock").exists():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def _ensure(self, wait: bool) -> tuple[str, int] | None:
        room = _room()
        if room is None:
            return None
        folder, owner = room
        sock, pid_file = folder / f"{self.name}.sock", folder / f"{self.name}.pid"
        with self._lock, open(folder / f"{self.name}.lock", "w") as lock:
            self._locked(lock, 240.0)  # one worker starts it; the others wait for it
            if not pid_file.exists():
                proc = self._launch(folder, sock, owner)
                if wait:
                    self._wait_listening(proc, folder, sock)
                pid_file.write_text(str(proc.pid))
        return str(sock), int(pid_file.read_text())

    def _locked(self, lock: Any, timeout_s: float) -> None:
        """Take the start lock (held while a worker starts the server: at most its 180 s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{self.name} fork server: another test process held its start lock "
                        f"for {timeout_s:.0f} s"
                    ) from None
                time.sleep(0.1)

    def server_pid(self) -> int | None:
        """The server's pid once started and while it runs."""
        room = _room()
        pid_file = room[0] / f"{self.name}.pid" if room else None
        if pid_file is None or not pid_file.exists():
            return None
        pid = int(pid_file.read_text())
        return pid if _alive(pid) else None

    def _launch(self, folder: Path, sock: Path, owner: int) -> subprocess.Popen:
        args = ["-m", "asyncrl.entrypoints.forkserver", "--listen", str(sock)]
        args += ["--preload", *self.preload, "--exit-with", str(owner)]
        env = python_env(self.env())
        env.pop(ENV_SHARED, None)
        with open(folder / f"{self.name}.log", "ab") as out:
            # not a child that dies with this worker (tests/conftest.py arms that for a
            # `preexec_fn` of None): it serves every worker until the session's end
            proc = subprocess.Popen(
                [sys.executable, *args, "--title-room", " " * 2048],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_no_op,
            )
        _started.append(proc)  # held: no "still running" warning when a worker ends first
        return proc

    def _wait_listening(self, proc: subprocess.Popen, folder: Path, sock: Path) -> None:
        log = folder / f"{self.name}.log"
        deadline = time.monotonic() + 180.0
        while not sock.exists():  # it binds once its imports are done
            if proc.poll() is not None:
                raise RuntimeError(f"{self.name} fork server exited: {log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                stop([proc])
                raise TimeoutError(f"{self.name} fork server silent for 180 s: {log}")
            time.sleep(0.1)

    def spawn(
        self, args: list[str], log: Path | None, env: dict[str, str], fresh: bool = False
    ) -> Any:
        """Start ``python ARGS`` (``-m MODULE ...``) with ``env``, forked from this server
        when it runs (module docstring), else as :func:`spawn_shared` starts it (``fresh``:
        a fresh interpreter, not a fork of the session's asyncrl fork server)."""
        path = self.socket_path()
        env = python_env(env)
        if path is not None:
            env[ENV_SHARED] = path
        elif fresh:
            env.pop(ENV_SHARED, None)
        return spawn_shared(args, log, env)

    def children(self) -> dict[int, str]:
        """The live processes the server forked (every worker's): pid -> command line."""
        pid = self.server_pid()
        return children(pid) if pid is not None else {}


_started: list[subprocess.Popen] = []


def _no_op() -> None:
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    state = Path(f"/proc/{pid}/stat")
    try:  # a zombie (ended, not yet reaped by whoever started it) is not running
        return state.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
