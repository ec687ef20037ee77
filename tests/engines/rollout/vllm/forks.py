"""One fork server per test process with vLLM 0.33's server code imported, for the vLLM test
servers (``app.py``) and vLLM's parser probe (``parse.py``).

Importing vLLM's CLI, app and ``AsyncLLM`` modules costs ~5.5 CPU-s (``vllm.config`` pulls
in torch's inductor, transformers and openai's types), paid by each of the ~20 test servers
and probes a suite starts; forked from a server that imported them once, a start costs a
fork. The server is an :mod:`asyncrl.entrypoints.forkserver` started with vLLM's own
environment (``code.vllm_env``: its source and its pinned server dependencies first on
the path, as a fresh ``app.py`` process has them), on the first vLLM start of a test
process that allowed it (:func:`allow`, the session fixture in tests/conftest.py), and
ends with that process, however it ends (``--exit-with``). Its socket is handed to the
processes the tests start (``ENV``), so a benchmark started by a test forks its vLLM server
there too; anywhere else (no server allowed or named), a start is what it was: forked from
the session's shared fork server (torch imported) or a fresh interpreter.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from asyncrl.forkserver import ENV_SHARED, spawn_shared
from asyncrl.procs import Proc, python_env, spawn, stop
from tests.engines.rollout.vllm.code import vllm_env

__all__ = [
    "ENV",
    "PRELOAD",
    "allow",
    "children",
    "close",
    "server_pid",
    "socket_path",
    "spawn_vllm",
]

ENV = "ASYNCRL_TEST_VLLM_FORK_SERVER"
"""The socket of the test session's vLLM fork server, once started."""

PRELOAD = (
    "tests.engines.rollout.vllm.app",
    "tests.engines.rollout.vllm.preload",
    "transformers.models.qwen2.modeling_qwen2",  # the stand-in's model class
)
"""What the server imports before it forks (``preload.py`` lists vLLM's own modules)."""

_lock = threading.Lock()
_folder: Path | None = None
_proc: Proc | None = None


def allow(folder: Path) -> None:
    """Let this process start the server (its socket and log in ``folder``) when first
    needed; a process that never starts a vLLM test server pays nothing."""
    global _folder
    _folder = folder


def server_pid() -> int | None:
    """The pid of the server this process started, while it runs."""
    return _proc.pid if _proc is not None and _proc.poll() is None else None


def children() -> dict[int, str]:
    """The live processes the server this process started forked: pid -> command line."""
    server = server_pid()
    out: dict[int, str] = {}
    for d in Path("/proc").iterdir() if server is not None else ():
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == server:
                out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):  # not a process, or gone meanwhile
            continue
    return out


def socket_path() -> str | None:
    """The server's socket (None: none here): started now if this process may and has
    none yet."""
    global _proc
    with _lock:
        if _folder is None:
            return os.environ.get(ENV)
        sock = _folder / "fs.sock"
        if _proc is None:
            args = ["-m", "asyncrl.entrypoints.forkserver", "--listen", str(sock)]
            args += ["--preload", *PRELOAD, "--exit-with", str(os.getpid())]
            env = python_env(vllm_env())
            env.pop(ENV_SHARED, None)
            _proc = spawn([*args, "--title-room", " " * 2048], _folder / "forkserver.log", env)
            _wait_listening(_proc, sock, _folder / "forkserver.log", 180.0)
            os.environ[ENV] = str(sock)
        return str(sock) if _proc.poll() is None else None


def _wait_listening(proc: Proc, sock: Path, log: Path, timeout_s: float) -> None:
    """Poll until the server listens (it binds once its imports are done)."""
    deadline = time.monotonic() + timeout_s
    while not sock.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM fork server exited: {log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            stop([proc])
            raise TimeoutError(f"vLLM fork server silent for {timeout_s}s: {log}")
        time.sleep(0.1)


def spawn_vllm(args: list[str], log: Path, env: dict[str, str]) -> Any:
    """Start ``python ARGS`` (``-m MODULE ...``) with ``env`` (``code.vllm_env``'s path),
    forked from the vLLM fork server when there is one (module docstring)."""
    path = socket_path()
    env = python_env(env)
    if path is not None:
        env[ENV_SHARED] = path
    return spawn_shared(args, log, env)


def close() -> None:
    """Stop the server this process started (its children with it)."""
    global _proc, _folder
    with _lock:
        if _proc is not None:
            stop([_proc])
        _proc, _folder = None, None
        os.environ.pop(ENV, None)
