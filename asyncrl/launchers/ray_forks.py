"""One fork server per node of a Ray run (``cluster.fork_server``, as for local runs).

A :class:`NodeForkServer` actor (one per run and node: named ``asyncrl-forkserver-RUN-NODE``,
pinned to its node with a hard ``NodeAffinitySchedulingStrategy``, ``num_cpus=0``) starts
``python -m asyncrl.entrypoints.forkserver --listen SOCKET --exit-with ACTOR_PID --preload
...`` there: the trainer's and the embedded engine's modules and the model's class, imported
once. Each :class:`~asyncrl.launchers.ray_actor.ProcActor` on that node connects to it and
forks its process there (its connection owns the process: the server SIGKILLs it when the
connection closes). The server ends with its actor, however the actor ends (``--exit-with``
watches a pidfd of the actor), and SIGKILLs every process it forked on the way out; and
each process it forked dies with it, however it dies (``--children-die-with-server``: a
Ray worker that exits SIGKILLs its own children, the server among them, which may come
before the server has read that the actors' connections closed).

``SOCKET`` is ``$TMPDIR/asyncrl-UID/fs-RANDOM.sock`` on the node: a folder of this user's
only (mode 0700, checked: owner and mode) and a socket of mode 0600, so only this user can
connect, and a path nobody can guess or take first. A server removes its socket as it
ends; one SIGKILLed first (a Ray worker SIGKILLs its children as it exits: the driver's
death ends the node's actor that way) leaves it, and the next node server started there
removes the sockets nothing listens on (:func:`sweep`). The run secret never reaches the
server's command line or environment: each fork request carries the secret of its run
(:meth:`asyncrl.forkserver.ForkServer.spawn`). The server's output: ``RUN_DIR/forkserver-
ADDRESS.log`` on its node. It is not one of the run's processes (``processes.json``): it
starts nothing on its own and ends with the run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from asyncrl import secret
from asyncrl.forkserver import model_module
from asyncrl.launchers.base import log_tail
from asyncrl.procs import private_folder, python_env, spawn, stop

__all__ = ["NodeForkServer", "NodeForks"]

log = logging.getLogger("asyncrl.launchers.ray")


def sweep(folder: Path) -> list[str]:
    """Remove the sockets in ``folder`` that nothing listens on any more (a server SIGKILLed
    before it could remove its own); the names removed."""
    gone = []
    for path in folder.glob("fs-*.sock"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5.0)
            try:
                sock.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                gone.append(path.name)
            except OSError:
                continue  # busy, or not ours to judge: left as it is
    return gone


class NodeForkServer:
    """The run's fork server on the node this actor lives on (wrapped by ``ray.remote``)."""

    def __init__(self, run_dir: str):
        self.run_dir = Path(run_dir)
        self.proc: subprocess.Popen | None = None
        self.socket = ""
        self.log = Path()

    def start(self, preload: Sequence[str], model_path: str) -> None:
        """Start the server, importing ``preload`` and ``model_path``'s model class (the caller
        goes on meanwhile: :meth:`ready`)."""
        if self.proc is not None:
            return
        mods = [*preload, *filter(None, [model_module(model_path)])]
        folder = private_folder()
        sweep(folder)
        self.socket = str(folder / f"fs-{secrets.token_hex(8)}.sock")
        address = ray.util.get_node_ip_address()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = self.run_dir / f"forkserver-{address}.log"
        args = ["-m", "asyncrl.entrypoints.forkserver", "--listen", self.socket]
        args += ["--exit-with", str(os.getpid()), "--children-die-with-server"]
        args += ["--preload", *mods]
        args += ["--title-room", " " * 2048]  # room for the children's command lines
        # a throwaway secret for the server itself: every fork request brings its run's
        self.proc = spawn(args, self.log, env=python_env(), secret=secret.generate())

    def ready(self, timeout_s: float) -> dict[str, Any]:
        """``{"socket": PATH, "pid": PID}`` once the server listens (waiting up to
        ``timeout_s`` while it imports), or ``{"error": WHY}``."""
        deadline = time.monotonic() + timeout_s
        while self.proc is not None and not os.path.exists(self.socket):
            if self.proc.poll() is not None:
                tail = log_tail(self.log, 10)
                return {"error": f"it exited with {self.proc.returncode}: {tail}"}
            if time.monotonic() > deadline:
                return {"error": f"not listening after {timeout_s:.0f} s (log: {self.log})"}
            time.sleep(0.05)
        if self.proc is None:
            return {"error": "not started"}
        return {"socket": self.socket, "pid": self.proc.pid}

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the server (SIGTERM: it SIGKILLs what it forked, removes its socket)."""
        if self.proc is not None:
            stop([self.proc], timeout_s)


class NodeForks:
    """The driver's side: one :class:`NodeForkServer` per node the run's forked processes
    need (started at the first such process there), stopped with the run."""

    def __init__(
        self, run_dir: Path, preload: Sequence[str], call: Callable[[Any, str, float], Any]
    ):
        self.run_dir = run_dir
        self.preload = list(preload)
        self.tag = secrets.token_hex(4)  # this run's actors' names
        self._call = call
        self._remote = ray.remote(NodeForkServer)
        self._actors: dict[str, Any] = {}  # node id -> its actor
        self._started: dict[str, Any] = {}  # node id -> its start call (errors come from it)
        self._sockets: dict[str, str] = {}  # node id -> its socket; "" when it failed

    def start(self, node_id: str, model_path: str) -> None:
        """Start the node's server (once) without waiting for its imports."""
        if node_id in self._actors:
            return
        actor: Any = self._remote.options(
            name=f"asyncrl-forkserver-{self.tag}-{node_id[:12]}",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            num_cpus=0,
            max_restarts=0,
            max_concurrency=1,
        ).remote(str(self.run_dir))
        self._actors[node_id] = actor
        self._started[node_id] = actor.start.remote(self.preload, model_path)

    def socket(self, node_id: str, address: str, timeout_s: float = 180.0) -> str:
        """The node's server's socket once it listens; "" when it could not start (a warning
        says why once: that node's processes start fresh)."""
        if node_id not in self._sockets:
            what = f"the fork server on {address}"
            try:
                self._call(self._started[node_id], f"{what}: start()", 60.0)
                ref = self._actors[node_id].ready.remote(timeout_s)
                got = self._call(ref, what, timeout_s + 30)
            except (ray.exceptions.RayError, RuntimeError) as exc:
                got = {"error": str(exc)}
            if "error" in got:
                log.warning("%s: %s; its processes start fresh", what, got["error"])
            self._sockets[node_id] = got.get("socket", "")
        return self._sockets[node_id]

    def stop(self) -> None:
        """End every node's server, then its actor."""
        refs = [a.stop.remote(5.0) for a in self._actors.values()]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=15.0)
        for actor in self._actors.values():
            with contextlib.suppress(ray.exceptions.RayError, ValueError):
                ray.kill(actor, no_restart=True)
        self._actors.clear()
        self._started.clear()
        self._sockets.clear()
