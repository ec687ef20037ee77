"""A fork server: one pre-imported Python per run that starts the run's own processes by fork.

Every trainer rank and embedded engine of a run imports the same heavy modules (torch,
transformers, the model's class, FSDP): ~3 CPU-seconds each on a CPU box, paid again by
every restart. ``asyncrl run`` (local launcher, CPU runs by default: ``cluster.fork_server``)
starts one :class:`ForkServer` that imports them once; each process is then a fork of it
running its module as ``python -m MODULE ARGS`` would (its own session, its own log file,
the environment it was given, ``sys.argv`` as ``-m`` sets it).

Contract:

- Only ``-m MODULE ...`` argument lists are forked (:meth:`ForkServer.serves`); anything
  else (SGLang, vLLM, ``-c`` code) is started by :func:`asyncrl.procs.spawn` as before.
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
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from asyncrl.procs import pid_alive, python_env, spawn

__all__ = ["ForkServer", "Forked", "model_module"]

_TITLE_ROOM = 2048
"""Bytes of the server's command line kept for its children's (what ``ps`` shows)."""

_START_TIMEOUT_S = 60.0
"""Seconds a fork may take to be answered (the server is idle otherwise)."""


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

    def __init__(self, proc: subprocess.Popen, sock: socket.socket):
        self.proc = proc
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
        args = ["-m", "asyncrl.forkserver", "--fd", str(theirs.fileno()), "--preload", *preload]
        args += ["--title-room", " " * _TITLE_ROOM]  # room for the children's command lines
        proc = spawn(args, log_path, env=python_env(), pass_fds=(theirs.fileno(),))
        theirs.close()
        server = cls(proc, ours)
        server._ready_timeout_s = timeout_s
        return server

    def _wait_ready(self) -> None:
        """Called with the lock held: RuntimeError with the reason if the server could not
        import what it preloads (or gave no sign in time)."""
        if self._ready is None:
            got = self._reply_locked(self._ready_timeout_s, "ready")
            self._ready = got.get("error", "")
        if self._ready:
            raise RuntimeError(f"fork server (pid {self.proc.pid}) failed: {self._ready}")

    @staticmethod
    def serves(args: Sequence[str]) -> bool:
        """Whether ``args`` (after ``python``) is a ``-m MODULE ...`` command it can fork."""
        return len(args) >= 2 and args[0] == "-m"

    def alive(self) -> bool:
        """Running, and not known to have failed its preload."""
        return self.proc.poll() is None and not self._ready

    def spawn(
        self,
        args: Sequence[str],
        log_path: Path | None,
        env: dict[str, str],
        cores: set[int] | None = None,
    ) -> Forked:
        """Fork ``python ARGS`` (``-m MODULE ...``) with ``env`` as its whole environment,
        output appended to ``log_path`` (None: the server's), on ``cores`` (Linux
        affinity; None: the server's). RuntimeError if the server cannot fork it."""
        if not self.serves(args):
            raise ValueError(f"the fork server runs `-m MODULE ...` only, got {list(args)[:3]}")
        from asyncrl.secret import ENV_FD, ENV_SECRET

        env = {k: v for k, v in env.items() if k not in (ENV_FD, ENV_SECRET)}
        with self._lock:
            self._wait_ready()
            self._ids += 1
            req = {"id": self._ids, "args": list(args), "env": env}
            req |= {"log": str(log_path) if log_path else None, "cores": sorted(cores or ())}
            self._send(req)
            got = self._reply_locked(_START_TIMEOUT_S, self._ids)
        if "error" in got:
            raise RuntimeError(f"fork server (pid {self.proc.pid}): {got['error']}")
        return Forked(self, int(got["pid"]), args)

    def close(self, timeout_s: float = 5.0) -> None:
        """End the server (it SIGKILLs what it started that still runs) and reap it."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    # -- the client side of the socket -------------------------------------------------

    def _send(self, msg: dict[str, Any]) -> None:
        self._sock.sendall(json.dumps(msg).encode() + b"\n")

    def _reply(self, timeout_s: float, want: int | str) -> dict[str, Any]:
        with self._lock:
            return self._reply_locked(timeout_s, want)

    def _reply_locked(self, timeout_s: float, want: int | str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            for msg in self._read(max(0.0, deadline - time.monotonic())):
                if msg.get("id") == want:
                    return msg
            if time.monotonic() >= deadline or self._sock.fileno() < 0:
                raise RuntimeError(
                    f"fork server (pid {self.proc.pid}) gave no answer in {timeout_s:.0f} s"
                    f" (exit code {self.proc.poll()})"
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


# -- the server ---------------------------------------------------------------------------


def _serve(fd: int, preload: Sequence[str]) -> None:
    from asyncrl import secret

    sock = socket.socket(fileno=fd)
    secret.load()  # from the pipe spawn() handed over: children inherit it in memory
    try:
        for name in preload:
            importlib.import_module(name)
    except BaseException as exc:
        err = f"import {name}: {exc!r}"
        sock.sendall(json.dumps({"id": "ready", "error": err}).encode() + b"\n")
        return
    if threading.active_count() > 1:  # forking a threaded process is not a fresh start
        err = f"preloading started threads: {[t.name for t in threading.enumerate()]}"
        sock.sendall(json.dumps({"id": "ready", "error": err}).encode() + b"\n")
        return
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    children: set[int] = set()
    sock.sendall(b'{"id": "ready"}\n')
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    buf = b""
    try:
        while True:
            for key, _ in sel.select():
                if key.fileobj == wake_r:
                    os.read(wake_r, 4096)
                    _reap(sock, children)
                    continue
                chunk = sock.recv(65536)
                if not chunk:
                    return
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    req = json.loads(line)
                    reply = _fork(req, sock, (wake_r, wake_w), sel)
                    if "pid" in reply:
                        children.add(reply["pid"])
                    sock.sendall(json.dumps(reply).encode() + b"\n")
    finally:
        for pid in children:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        try:
            sock.sendall(json.dumps({"exit": pid, "code": code}).encode() + b"\n")
        except OSError:
            pass


def _fork(
    req: dict[str, Any],
    sock: socket.socket,
    wake: tuple[int, int],
    sel: selectors.BaseSelector,
) -> dict[str, Any]:
    args: list[str] = req["args"]
    log = req.get("log")
    try:
        out = os.open(log or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:
        return {"id": req["id"], "error": f"cannot open log {log}: {exc}"}
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(out)
        return {"id": req["id"], "pid": pid}
    sel.close()
    _child(args, req["env"], out if log else None, set(req.get("cores") or ()), sock, wake)


def _child(
    args: list[str],
    env: dict[str, str],
    out: int | None,
    cores: set[int],
    sock: socket.socket,
    wake: tuple[int, int],
) -> NoReturn:
    """The forked child: become ``python -m MODULE ARGS``, run it, exit with its status."""
    code = 1
    try:
        _become(args, env, out, cores, sock, wake)
        import runpy

        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        _exit(code)


def _become(
    args: list[str],
    env: dict[str, str],
    out: int | None,
    cores: set[int],
    sock: socket.socket,
    wake: tuple[int, int],
) -> None:
    """Turn the forked child into ``python -m MODULE ARGS``: own session, signals at their
    defaults, its output, environment, cores and ``sys.argv``."""
    os.setsid()
    signal.set_wakeup_fd(-1)
    for fd in wake:
        os.close(fd)
    sock.close()
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if out is not None:
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
    os.environ.clear()
    os.environ.update(env)
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    threads = env.get("OMP_NUM_THREADS", "") or (str(len(cores)) if cores else "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        # OpenMP sized its pool when torch loaded it in the server: size it as a fresh
        # interpreter on these cores (or with this OMP_NUM_THREADS) would
        sys.modules["torch"].set_num_threads(int(threads))
    sys.argv = [args[1], *args[2:]]  # runpy puts the module's file in argv[0]
    _set_title([sys.executable, *args])


def _set_title(words: list[str]) -> None:
    """What ``ps`` and ``/proc/PID/cmdline`` show for this process becomes ``words`` (as if
    started as ``words``; cut to the room the server's command line holds), and its short
    name (``top``, ``comm``) the module's last part. Linux: rewrites the argv area as
    ``setproctitle`` does; elsewhere nothing."""
    import ctypes

    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (proc(5): 48, 49)
        libc = ctypes.CDLL(None)
    except (OSError, ValueError, IndexError):
        return
    data = b"\0".join(w.encode() for w in words)[: end - start - 1]
    ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)
    name = words[2].rsplit(".", 1)[-1].encode()[:15] if len(words) > 2 else b""
    libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _exit(code: int) -> NoReturn:
    """Leave the child as an interpreter would: atexit handlers, flushed output."""
    import atexit
    import logging

    try:
        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m asyncrl.forkserver")
    p.add_argument("--fd", type=int, required=True, help="the socket to the parent")
    p.add_argument("--preload", nargs="*", default=[], help="modules to import first")
    p.add_argument("--title-room", default="", help="blank room for children's titles")
    a = p.parse_args(argv)
    _serve(a.fd, a.preload)


if __name__ == "__main__":
    main()
