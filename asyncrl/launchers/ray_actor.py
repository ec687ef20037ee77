"""The thin Ray actor around one process of a run (runs on the node Ray placed it on).

It reports where it is (the node's address, its GPUs), hands out free ports on that
address, and starts, polls and stops one ``python -m`` process there — the same
command line a local run would use, output in ``<run_dir>/<name>.log`` on that node.
The process dies with the actor (parent-death signal), so a lost actor leaves no
orphan. Restart decisions are the driver's; the actor is never restarted by Ray.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from asyncrl.launchers.base import log_tail
from asyncrl.procs import free_port, python_env, spawn, stop
from asyncrl.trace import ENV_DIR

__all__ = ["ProcActor"]


class ProcActor:
    """One process of a run on the node this actor lives on (wrapped by ``ray.remote``)."""

    def __init__(self, run_dir: str):
        import ray

        self.name = ""
        self.run_dir = Path(run_dir)
        self.address = ray.util.get_node_ip_address()
        self.gpus = [str(g) for g in ray.get_gpu_ids()]
        self.proc: subprocess.Popen | None = None
        self.pids: list[int] = []  # every process this actor started
        self.trace_dir = ""  # where they write trace files (ASYNCRL_TRACE_DIR), if they do

    def node(self) -> dict[str, Any]:
        """Where this actor runs: ``address`` (the node's IP as the cluster knows it), ``gpus``."""
        return {"address": self.address, "gpus": self.gpus}

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
    ) -> int:
        """Write ``files`` (absolute path -> bytes) on this node, then start ``python args`` as
        process ``name`` (the last process of this actor is stopped first); returns its pid.
        ``secret``: the run secret, which came here as this call's argument (Ray's own
        channel) and goes on to the process through a pipe (:func:`asyncrl.secret.handoff`)."""
        self.stop(5.0)
        self.name = name
        for path, data in files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_bytes(data)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log = self.run_dir / f"{self.name}.log"
        self.proc = spawn(args, log, env=python_env(env), die_with_parent=True, secret=secret)
        self.pids.append(self.proc.pid)
        self.trace_dir = env.get(ENV_DIR, "")
        return self.proc.pid

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
