"""The thin Ray actor around one process of a run (runs on the node Ray placed it on).

It reports where it is (the node's address and id, its GPUs), hands out free ports on
that address, and starts, polls and stops one ``python -m`` process there — the same
command line a local run would use, output in ``<run_dir>/<name>.log`` on that node.
Started fresh, the process dies with the actor (parent-death signal); forked from a fork
server on the node (``start(fork=SOCKET)``: the node's server, :mod:`asyncrl.launchers.
ray_forks`, or a shared one), it is the server's child, and the actor's connection owns
it: the server SIGKILLs it when that connection closes, however the actor ends. Either
way a lost actor leaves no orphan. The actor itself never forks (a Ray worker runs
threads). Restart decisions are the driver's; the actor is never restarted by Ray.
"""

from __future__ import annotations

import logging
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

from asyncrl.forkserver import ForkServer
from asyncrl.launchers.base import log_tail
from asyncrl.procs import Proc, free_port, python_env, spawn, stop
from asyncrl.trace import ENV_DIR

log_ = logging.getLogger("asyncrl.launchers.ray_actor")

__all__ = ["ProcActor"]


class ProcActor:
    """One process of a run on the node this actor lives on (wrapped by ``ray.remote``)."""

    def __init__(self, run_dir: str):
        import ray

        self.name = ""
        self.run_dir = Path(run_dir)
        self.address = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.gpus = [str(g) for g in ray.get_gpu_ids()]
        self.proc: Proc | None = None
        self.pids: list[int] = []  # every process this actor started
        self.trace_dir = ""  # where they write trace files (ASYNCRL_TRACE_DIR), if they do
        self.server: ForkServer | None = None  # this actor's connection to a fork server

    def node(self, shared: str = "") -> dict[str, Any]:
        """Where this actor runs: ``address`` (the node's IP as the cluster knows it),
        ``node_id`` (Ray's), ``gpus``; ``shared``: whether ``shared`` is a unix socket on
        this node (a fork server shared by runs: ``ASYNCRL_FORK_SERVER``)."""
        return {
            "address": self.address,
            "node_id": self.node_id,
            "gpus": self.gpus,
            "shared": bool(shared) and _is_socket(shared),
        }

    def free_port(self) -> int:
        """A TCP port free on this node's address a moment ago."""
        return free_port(self.address)

    def model(self, path: str) -> str:
        """The model folder on this node: ``path`` when it holds a model, or (``path`` empty)
        the tiny default model, built here once. Raises ValueError naming the node."""
        if path:
            if not (Path(path) / "config.json").is_file():
                raise ValueError(f"model.path {path!r} is not a model folder on {self.address}")
            return path
        from asyncrl.tasks.tiny_model import default_model_dir

        out = default_model_dir()
        if not (out / "config.json").is_file():
            cmd = [sys.executable, "-m", "asyncrl.tasks.tiny_model", "--out", str(out)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=python_env())
        return str(out)

    def start(
        self,
        name: str,
        args: list[str],
        files: dict[str, bytes],
        env: dict[str, str],
        secret: str,
        fork: str = "",
    ) -> int:
        """Write ``files`` (absolute path -> bytes) on this node, then start ``python args`` as
        process ``name`` (the last process of this actor is stopped first); returns its pid.
        ``secret``: the run secret, which came here as this call's argument (Ray's own
        channel) and goes on to the process through a pipe (:func:`asyncrl.secret.handoff`),
        or over the fork server's socket. ``fork``: a fork server's socket on this node; a
        ``-m MODULE`` process is forked there when it answers, else started fresh."""
        self.stop(5.0)
        self.name = name
        for path, data in files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_bytes(data)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log = self.run_dir / f"{self.name}.log"
        self.proc = self._fork(fork, args, log, python_env(env), secret)
        if self.proc is None:
            self.proc = spawn(args, log, env=python_env(env), die_with_parent=True, secret=secret)
        self.pids.append(self.proc.pid)
        self.trace_dir = env.get(ENV_DIR, "")
        return self.proc.pid

    def _fork(
        self, path: str, args: list[str], log: Path, env: dict[str, str], secret: str
    ) -> Proc | None:
        """``args`` forked by the fork server at ``path`` (over this actor's one connection
        to it), or None: no server there, or not a command it forks (a warning says why
        when the server fails)."""
        if not path or not ForkServer.serves(args) or not _is_socket(path):
            return None
        try:
            if self.server is None or self.server.where != path or not self.server.alive():
                if self.server is not None:
                    self.server.close()
                self.server = None
                self.server = ForkServer.connect(path, timeout_s=60.0)
            return self.server.spawn(args, log, env, secret=secret)
        except (OSError, RuntimeError) as exc:
            log_.warning("%s: %s; starting a fresh process", self.name, exc)
            return None

    def trace_files(self) -> dict[str, bytes]:
        """The trace files (``trace/<process>-<pid>.jsonl``) of every process this actor
        started, by file name; empty when they did not trace."""
        if not self.trace_dir:
            return {}
        folder = Path(self.trace_dir) / "trace"
        out = {}
        for pid in self.pids:
            for f in folder.glob(f"*-{pid}.jsonl"):
                out[f.name] = f.read_bytes()
        return out

    def poll(self) -> int | None:
        """The process's exit status, or None while it runs (or before it started)."""
        return None if self.proc is None else self.proc.poll()

    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def log_tail(self, lines: int = 20) -> str:
        if not self.name:
            return "(not started)"
        return log_tail(self.run_dir / f"{self.name}.log", lines)

    def wait(self, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s`` for the process to exit on its own; its status or None."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM the process group, wait up to ``timeout_s``, then SIGKILL it."""
        if self.proc is not None:
            stop([self.proc], timeout_s)


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(Path(path).stat().st_mode)
    except OSError:
        return False
