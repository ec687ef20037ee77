"""The fork server process (client and contract: :mod:`asyncrl.forkserver`).

``python -m asyncrl.entrypoints.forkserver --fd N --preload MOD ...``: one run's server,
whose only connection is the inherited socket ``N``; it exits once that closes.
``... --listen PATH --preload MOD ...``: a server shared by the runs that name ``PATH``
in ``ASYNCRL_FORK_SERVER`` (a unix socket, mode 0600); it runs until SIGTERM/SIGINT, or,
with ``--exit-with PID``, until process ``PID`` ends, however it ends (a SIGKILLed test
worker must not leave a ~460 MB server and its children behind: the server watches a
``pidfd`` of ``PID``, Linux >= 5.3, and falls back to polling ``PID`` once a second).
With ``--children-die-with-server`` each child is SIGKILLed when the server dies, however
it dies (Linux ``PR_SET_PDEATHSIG``): a server SIGKILLed before it could kill them (a Ray
worker SIGKILLs its own children as it exits) leaves none behind.

Each connection sends JSON lines ``{"id", "args", "env", "cwd", "log", "cores",
"secret"?}`` and gets ``{"id", "pid"}`` or ``{"id", "error"}``, and ``{"exit": PID,
"code": C}`` when one of its children ends. When a connection closes, every child forked
for it that still runs is SIGKILLed (its whole session); on exit, every child is. The
server then leaves at once (atexit handlers run, output flushed), skipping the interpreter's
teardown of what it preloaded. A child forgets the preloaded copy of the module it runs
(runpy runs that module's code as ``__main__``, as ``python -m`` does).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from asyncrl.procs import die_with_parent_fn, proc_stat

__all__ = ["main"]


@dataclass
class _Conn:
    sock: socket.socket
    owner: bool  # the run's own connection: the server ends with it
    buf: bytes = b""
    children: set[int] = field(default_factory=set)


class _Server:
    def __init__(
        self, listener: socket.socket | None, watch: int | None = None, bind: bool = False
    ):
        self.listener = listener
        self.watch = watch
        self.arm = die_with_parent_fn() if bind else None  # run in each child: dies with us
        self.sel = selectors.DefaultSelector()
        self.conns: dict[int, _Conn] = {}  # by fileno
        self.owner_of: dict[int, _Conn] = {}  # child pid -> its connection
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.sel.register(self.wake_r, selectors.EVENT_READ)
        if listener is not None:
            self.sel.register(listener, selectors.EVENT_READ)
        self.pidfd: int | None = None
        if watch is not None and hasattr(os, "pidfd_open"):
            try:
                self.pidfd = os.pidfd_open(watch)
            except OSError:  # already gone (ProcessLookupError) or no pidfd in this kernel
                self.pidfd = None
            if self.pidfd is not None:
                self.sel.register(self.pidfd, selectors.EVENT_READ)

    def watched_gone(self) -> bool:
        """``--exit-with PID`` without a pidfd: whether that process has ended (polled)."""
        if self.watch is None:
            return False
        try:
            os.kill(self.watch, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def add(self, sock: socket.socket, owner: bool) -> None:
        conn = _Conn(sock, owner)
        self.conns[sock.fileno()] = conn
        self.sel.register(sock, selectors.EVENT_READ, conn)
        _send(sock, {"id": "ready"})

    def loop(self) -> None:
        """Serve until the owner's connection closes (or, shared, until a signal or the
        ``--exit-with`` process's end)."""
        poll_s = 1.0 if self.watch is not None and self.pidfd is None else None
        if poll_s is not None and self.watched_gone():
            return
        while True:
            events = self.sel.select(poll_s)
            if poll_s is not None and not events and self.watched_gone():
                return
            for key, _ in events:
                if self.pidfd is not None and key.fileobj == self.pidfd:
                    return  # the watched process ended
                if key.fileobj == self.wake_r:
                    os.read(self.wake_r, 4096)
                    self.reap()
                elif key.fileobj is self.listener:
                    sock, _ = self.listener.accept()
                    self.add(sock, owner=False)
                elif not self.serve(key.data) and key.data.owner:
                    return

    def serve(self, conn: _Conn) -> bool:
        """Handle what ``conn`` sent; False once it closed (its children are then killed)."""
        try:
            chunk = conn.sock.recv(65536)
        except OSError:
            chunk = b""
        if not chunk:
            self.sel.unregister(conn.sock)
            del self.conns[conn.sock.fileno()]
            conn.sock.close()
            _kill(conn.children)
            return False
        conn.buf += chunk
        *lines, conn.buf = conn.buf.split(b"\n")
        for line in lines:
            req = json.loads(line)
            reply = self.fork(req)
            if "pid" in reply:
                conn.children.add(reply["pid"])
                self.owner_of[reply["pid"]] = conn
            _send(conn.sock, reply)
        return True

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.owner_of.pop(pid, None)
            if conn is not None and pid in conn.children:
                conn.children.discard(pid)
                if conn.sock.fileno() >= 0:
                    _send(conn.sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    def fork(self, req: dict[str, Any]) -> dict[str, Any]:
        log = req.get("log")
        if log and req.get("cwd"):  # a relative log is the client's: `runs/...` of its cwd
            log = os.path.join(req["cwd"], log)
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
        self.forget()
        if self.arm is not None:
            self.arm()
        _child(req, out if log else None)

    def forget(self) -> None:
        """In a forked child: drop every descriptor and handler of the server."""
        signal.set_wakeup_fd(-1)
        self.sel.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)
        for conn in self.conns.values():
            conn.sock.close()
        if self.listener is not None:
            self.listener.close()

    def kill_all(self) -> None:
        _kill({pid for conn in self.conns.values() for pid in conn.children})


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    try:
        sock.sendall(json.dumps(msg).encode() + b"\n")
    except OSError:
        pass  # the client went away: its children are killed when its close is read


def _kill(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass


def _child(req: dict[str, Any], out: int | None) -> NoReturn:
    """The forked child: become ``python -m MODULE ARGS``, run it, exit with its status."""
    args: list[str] = req["args"]
    code = 1
    try:
        _become(req, out)
        import runpy

        _unimport(args[1])
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        _exit(code)


def _unimport(module: str) -> None:
    """Forget the preloaded ``module`` itself (what it imported stays imported), as a fresh
    ``python -m module`` has never imported it: its code then runs once, as ``__main__``,
    and importing it later imports it afresh. runpy would otherwise warn in every child's
    log that it was "found in sys.modules ... prior to execution" (a preloaded module is).
    A package stays: ``python -m package`` imports it too, and runs its ``__main__``."""
    if hasattr(sys.modules.get(module), "__path__"):
        return
    sys.modules.pop(module, None)
    package, _, name = module.rpartition(".")
    if package in sys.modules and hasattr(sys.modules[package], name):
        delattr(sys.modules[package], name)


def _become(req: dict[str, Any], out: int | None) -> None:
    """Turn the forked child into ``python -m MODULE ARGS``: own session, signals at their
    defaults, its output, directory, environment, secret, cores and ``sys.argv``."""
    args: list[str] = req["args"]
    env: dict[str, str] = req["env"]
    cores = set(req.get("cores") or ())
    os.setsid()
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
    if req.get("cwd"):
        os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(env)
    if "tempfile" in sys.modules:  # its folder comes from TMPDIR, read once: read it anew
        import tempfile

        tempfile.tempdir = None
    # a fresh interpreter puts PYTHONPATH first on sys.path: entries the server lacks go
    # there (what it imported already stays as imported)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra
    if req.get("secret"):
        from asyncrl import secret

        secret.use(req["secret"])
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

    fields = proc_stat("self")
    if fields is None:  # no /proc: nothing to rewrite
        return
    try:
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


def _preload(modules: Sequence[str]) -> str:
    """Import ``modules``; "" or why the server cannot serve (a failed import, threads)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:
            return f"import {name}: {exc!r}"
    if threading.active_count() > 1:  # forking a threaded process is not a fresh start
        return f"preloading started threads: {[t.name for t in threading.enumerate()]}"
    return ""


def _listen(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket file: mode 0600, this user only
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(64)
    return sock


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m asyncrl.entrypoints.forkserver")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--fd", type=int, help="the run's socket: serve it, exit when it closes")
    where.add_argument("--listen", help="a unix socket path to serve many runs on")
    p.add_argument("--preload", nargs="*", default=[], help="modules to import first")
    p.add_argument("--title-room", default="", help="blank room for children's titles")
    p.add_argument(
        "--exit-with",
        type=int,
        metavar="PID",
        help="exit (ending every child) when process PID ends, however it ends",
    )
    p.add_argument(
        "--children-die-with-server",
        action="store_true",
        help="each child is SIGKILLed when this server dies, however it dies (Linux)",
    )
    a = p.parse_args(argv)
    from asyncrl import secret

    secret.load()  # a run's: from the pipe spawn() handed over; children inherit it
    error = _preload(a.preload)
    if a.fd is not None:
        sock = socket.socket(fileno=a.fd)
        if error:
            _send(sock, {"id": "ready", "error": error})
            return
    elif error:
        sys.exit(f"fork server: {error}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    listener = _listen(a.listen) if a.listen else None
    server = _Server(listener, a.exit_with, a.children_die_with_server)
    try:
        if a.fd is not None:
            server.add(sock, owner=True)
        server.loop()
    finally:
        server.kill_all()
        if a.listen:
            os.unlink(a.listen)


def _serve_and_leave() -> NoReturn:
    """:func:`main`, then leave as :func:`_exit` does: by then every child is ended and every
    socket closed, and the interpreter's own teardown of what the server preloaded (torch,
    transformers: ~1 s, which the run waits for as it stops the server) has nothing to do."""
    code = 1
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        _exit(code)


if __name__ == "__main__":
    _serve_and_leave()
