"""A fork server: one pre-imported Python per run that starts the run's own processes by fork.

Every trainer rank and embedded engine of a run imports the same heavy modules (torch,
transformers, the model's class, FSDP): ~3 CPU-seconds each on a CPU box, paid again by
every restart. ``asyncrl run`` (local launcher, CPU runs by default: ``cluster.fork_server``)
starts one :class:`ForkServer` that imports them once; each process is then a fork of it
running its module as ``python -m MODULE ARGS`` would (its own session, its own log file,
the environment it was given, ``sys.argv`` as ``-m`` sets it).

Contract:

- Only ``-m MODULE ...`` argument lists can be forked (:meth:`ForkServer.serves`), and the
  launchers fork only the modules the server preloads (trainer ranks, embedded engines);
  anything else (SGLang and vLLM behind ``-m asyncrl.entrypoints.keyed``, ``-c`` code) is
  started by :func:`asyncrl.procs.spawn` as before.
- The server never initialises CUDA, starts no thread and creates no intra-op pool before
  it forks, so a child is what a fresh interpreter with those modules imported would be.
  CUDA cannot be used in a process forked after CUDA was initialised, which is why
  ``cluster.fork_server = "auto"`` turns the server on only where no process of the run
  uses a GPU.
- The run secret is the server's (handed to it by :func:`asyncrl.procs.spawn`, read before
  any fork): a child has it in memory, never in its environment or argv.
- A child is handed back as a :class:`Forked`, the part of ``subprocess.Popen`` the
  launchers use (``pid``, ``returncode``, ``poll``, ``wait``); its exit code comes from the
  server, which reaps it (``-N`` for a signal, as Popen). Control messages are JSON lines
  over a socketpair: no pickle.
- When the server's parent closes the socket (or dies), the server SIGKILLs every child it
  started that is still running, then exits.

A server can also be shared by several runs (sweeps of small runs, a test session):
``python -m asyncrl.entrypoints.forkserver --listen PATH --preload MOD ...`` serves a unix
socket (mode 0600), and every run whose environment has ``ASYNCRL_FORK_SERVER=PATH``
forks its processes there instead of starting its own (:meth:`ForkServer.connect`). Each
run's connection owns its children (killed when it closes); the run's secret and working
directory travel with each request (over the socket: never argv or environment). The
shared server is not the run's: it is not in ``processes.json``, and the run's processes
are not descendants of ``asyncrl run`` (their ``/proc/PID/environ`` is the server's).
Benchmarks that start helper processes use it the same way (:func:`spawn_shared`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.procs import Proc, pid_alive, python_env, spawn

__all__ = ["ENV_SHARED", "ForkServer", "Forked", "model_module", "spawn_shared"]

ENV_SHARED = "ASYNCRL_FORK_SERVER"
"""A shared server's socket path: runs started with it fork their processes there."""

_TITLE_ROOM = 2048
"""Bytes of the server's command line kept for its children's (what ``ps`` shows)."""

_START_TIMEOUT_S = 60.0
"""Seconds a fork may take to be answered (the server is idle otherwise)."""

_connections: dict[str, ForkServer] = {}
_connections_lock = threading.Lock()


class Forked:
    """A process forked by a :class:`ForkServer`: ``subprocess.Popen``'s ``pid``,
    ``returncode``, ``poll`` and ``wait`` (raising ``subprocess.TimeoutExpired``)."""

    def __init__(self, server: ForkServer, pid: int, args: Sequence[str]):
        self.server = server
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server._exit_code(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server._exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def __repr__(self) -> str:
        return f"<Forked pid={self.pid} returncode={self.returncode}>"


class ForkServer:
    """The run's fork server: start with :meth:`start`, fork with :meth:`spawn`, end with
    :meth:`close`. Thread-safe; the launcher calls it from its own threads."""

    def __init__(self, proc: subprocess.Popen | None, sock: socket.socket, where: str):
        self.proc = proc  # None: a shared server (not ours to stop)
        self.where = where  # for messages: "pid N" or the shared socket's path
        self._gone = False  # the connection closed
        self._sock = sock
        self._buf = b""
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        self._ids = 0
        self._ready: str | None = None  # "" once ready, else why it is not
        self._ready_timeout_s = 120.0

    @classmethod
    def start(
        cls, preload: Sequence[str], log_path: Path | None = None, timeout_s: float = 120.0
    ) -> ForkServer:
        """Start the server; it imports ``preload`` while the caller goes on (the first
        :meth:`spawn` waits for that, up to ``timeout_s``)."""
        ours, theirs = socket.socketpair()
        os.set_inheritable(theirs.fileno(), True)
        args = ["-m", "asyncrl.entrypoints.forkserver", "--fd", str(theirs.fileno())]
        args += ["--preload", *preload]
        args += ["--title-room", " " * _TITLE_ROOM]  # room for the children's command lines
        proc = spawn(args, log_path, env=python_env(), pass_fds=(theirs.fileno(),))
        theirs.close()
        server = cls(proc, ours, f"pid {proc.pid}")
        server._ready_timeout_s = timeout_s
        return server

    @classmethod
    def connect(cls, path: str, timeout_s: float = 10.0) -> ForkServer:
        """A connection to the shared server listening on ``path`` (see the module's
        docstring). OSError naming ``path`` when nothing answers there."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise OSError(f"no fork server answers at {path} ({ENV_SHARED}): {exc}") from exc
        server = cls(None, sock, path)
        server._ready_timeout_s = timeout_s
        return server

    def _wait_ready(self) -> None:
        """Called with the lock held: RuntimeError with the reason if the server could not
        import what it preloads (or gave no sign in time)."""
        if self._ready is None:
            got = self._reply_locked(self._ready_timeout_s, "ready")
            self._ready = got.get("error", "")
        if self._ready:
            raise RuntimeError(f"fork server ({self.where}) failed: {self._ready}")

    @staticmethod
    def serves(args: Sequence[str]) -> bool:
        """Whether ``args`` (after ``python``) is a ``-m MODULE ...`` command it can fork."""
        return len(args) >= 2 and args[0] == "-m"

    def alive(self) -> bool:
        """Running (connected), and not known to have failed its preload."""
        running = not self._gone if self.proc is None else self.proc.poll() is None
        return running and not self._ready

    def spawn(
        self,
        args: Sequence[str],
        log_path: Path | None,
        env: dict[str, str],
        cores: set[int] | None = None,
        secret: str | None = None,
    ) -> Forked:
        """Fork ``python ARGS`` (``-m MODULE ...``) with ``env`` as its whole environment,
        output appended to ``log_path`` (None: the server's), on ``cores`` (Linux
        affinity; None: the server's). A shared server's child gets ``secret`` (None: this
        process's, :func:`asyncrl.secret.load`). RuntimeError if the server cannot fork it."""
        if not self.serves(args):
            raise ValueError(f"the fork server runs `-m MODULE ...` only, got {list(args)[:3]}")
        from asyncrl.secret import ENV_FD, ENV_SECRET

        env = {k: v for k, v in env.items() if k not in (ENV_FD, ENV_SECRET)}
        with self._lock:
            self._wait_ready()
            self._ids += 1
            req = {"id": self._ids, "args": list(args), "env": env, "cwd": os.getcwd()}
            req |= {"log": str(log_path) if log_path else None, "cores": sorted(cores or ())}
            if self.proc is None:  # a shared server: this run's secret goes with the request
                from asyncrl.secret import load

                req["secret"] = load() if secret is None else secret
            self._send(req)
            got = self._reply_locked(_START_TIMEOUT_S, self._ids)
        if "error" in got:
            raise RuntimeError(f"fork server ({self.where}): {got['error']}")
        return Forked(self, int(got["pid"]), args)

    def close(self, timeout_s: float = 5.0) -> None:
        """End the server (it SIGKILLs what it started that still runs) and reap it; a
        shared server only ends this connection (and so its children)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    # -- the client side of the socket -------------------------------------------------

    def _send(self, msg: dict[str, Any]) -> None:
        self._sock.sendall(json.dumps(msg).encode() + b"\n")

    def _reply_locked(self, timeout_s: float, want: int | str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            for msg in self._read(max(0.0, deadline - time.monotonic())):
                if msg.get("id") == want:
                    return msg
            if time.monotonic() >= deadline or self._sock.fileno() < 0:
                code = "" if self.proc is None else f" (exit code {self.proc.poll()})"
                raise RuntimeError(
                    f"fork server ({self.where}) gave no answer in {timeout_s:.0f} s{code}"
                )

    def _read(self, timeout_s: float) -> list[dict[str, Any]]:
        """Messages that arrived within ``timeout_s``; exit reports are filed on the way."""
        self._sock.settimeout(timeout_s if timeout_s > 0 else 0.0)
        try:
            chunk = self._sock.recv(65536)
        except (TimeoutError, BlockingIOError, InterruptedError):
            return []
        except OSError:
            chunk = b""
        if not chunk:  # the server is gone
            self._gone = True
            time.sleep(min(timeout_s, 0.05))
            return []
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        out = []
        for line in lines:
            msg = json.loads(line)
            if "exit" in msg:
                self._exits[int(msg["exit"])] = int(msg["code"])
            else:
                out.append(msg)
        return out

    def _exit_code(self, pid: int, timeout_s: float | None) -> int | None:
        """``pid``'s exit code once the server reaped it, waiting up to ``timeout_s`` (None:
        for ever). A child whose server is gone has no code: -9 once it no longer runs."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                if pid in self._exits:
                    return self._exits[pid]
                if not self.alive() and not pid_alive(pid):
                    return self._exits.setdefault(pid, -signal.SIGKILL)
                left = 0.2 if deadline is None else deadline - time.monotonic()
                self._read(min(max(left, 0.0), 0.2))
                if pid in self._exits:
                    return self._exits[pid]
            if deadline is not None and time.monotonic() >= deadline:
                return None


def model_module(model_path: str) -> str | None:
    """The ``transformers`` module of the causal-LM class a Hugging Face folder's
    ``config.json`` names (what ``AutoModelForCausalLM`` imports), or None."""
    try:
        model_type = json.loads((Path(model_path) / "config.json").read_text())["model_type"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(model_type, str) or not model_type.isidentifier():
        return None
    return f"transformers.models.{model_type}.modeling_{model_type}"


def spawn_shared(
    args: Sequence[str],
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    die_with_parent: bool = False,
) -> Proc:
    """Start ``python ARGS`` forked from the shared fork server named by ``ASYNCRL_FORK_SERVER``
    when one is set, answers and serves ``ARGS`` (``-m MODULE ...``); else a fresh process
    (:func:`asyncrl.procs.spawn`, with ``die_with_parent``). A forked child ends when this
    process's connection closes, however this process dies (the server SIGKILLs what a
    closed connection started): what ``die_with_parent`` gives a fresh one. One connection
    per server per process, opened at the first call."""
    path = (env or os.environ).get(ENV_SHARED)
    if path and ForkServer.serves(args):
        try:
            with _connections_lock:
                server = _connections.get(path)
                if server is None or not server.alive():
                    server = _connections[path] = ForkServer.connect(path)
            return server.spawn(args, log_path, env or python_env())
        except (OSError, RuntimeError):
            pass  # not up (yet), or gone: a fresh process
    return spawn(args, log_path, env=env, die_with_parent=die_with_parent)
