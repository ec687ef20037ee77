"""``cluster.backend = "local"``: every process of the run is a child of ``asyncrl run``.

Each child starts in its own session (stopping it by pid ends its tree) with its
output in ``run_dir/<name>.log``. Addresses are the configured ones (loopback by
default): engines bind ``rollout.host``, trainer rank 0 advertises
``weights.master_address`` for the rendezvous and the weight-sync group, the
driver binds ``experience.host``. A restarted process gets the very same command
line (an engine keeps its port, so its URL is unchanged). With ``cluster.fork_server``
on, trainer ranks and embedded engines are forks of the run's fork server
(:mod:`asyncrl.forkserver`, its output in ``run_dir/forkserver.log``): same command
lines, environment, sessions and logs, without importing torch again. Other programs
(SGLang, vLLM, started behind ``-m asyncrl.entrypoints.keyed``) start as fresh processes,
as the Ray launcher starts them: the server preloads nothing they import, and a fork of it
would carry the trainer's ~460 MB of preloaded modules into a GPU server that never uses
them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from asyncrl.config import RunConfig
from asyncrl.engines.rollout.factory import family
from asyncrl.engines.rollout.launcher import launch_command, lora_engine_args
from asyncrl.engines.rollout.launcher import start_engines as launch_engines
from asyncrl.forkserver import ENV_SHARED, ForkServer, model_module
from asyncrl.launchers.base import Death, Placed, TrainerArgs, log_tail, trainer_command
from asyncrl.procs import Proc, free_port, python_env, spawn, stop, wait_exit

__all__ = ["LocalLauncher", "fork_server_wanted"]

TRAINER = "asyncrl.entrypoints.trainer"
"""The trainer ranks' module (:func:`~asyncrl.launchers.base.trainer_command`)."""

log_ = logging.getLogger("asyncrl.launcher")


class LocalLauncher:
    """The :class:`~asyncrl.launchers.base.Launcher` of child processes on this host.

    ``pin`` maps ``"engine"`` / ``"trainer"`` to the CPU cores their processes get (Linux).
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, pin: dict[str, set[int]] | None = None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.pin = pin or {}
        self.procs: dict[str, Proc] = {}
        self.fork_server: ForkServer | None = None
        self._cmds: dict[str, tuple[list[str], dict[str, str]]] = {}
        self._urls: dict[str, str] = {}
        self._hosts: dict[str, str] = {}
        self._reported: set[str] = set()
        # what the fork server preloads and forks: the trainer's module and the servers' (the
        # embedded engine's; none for SGLang and vLLM, or when the engines run elsewhere)
        self._forked = [TRAINER, *(() if cfg.rollout.urls else family(cfg.rollout).preload)]

    def advertise_host(self) -> str:
        return self.cfg.experience.host

    def prepare(self, model_path: str) -> None:
        self._start_fork_server(model_path)

    def start_engines(self, model_path: str) -> list[str]:
        cfg = self.cfg
        self._start_fork_server(model_path)
        with _pinned(self.pin.get("engine")):
            urls, servers = launch_engines(
                cfg.rollout,
                model_path,
                self.run_dir,
                cfg.model.dtype,
                cfg.seed,
                cfg.weights.master_address,
                lora=lora_engine_args(cfg),
                spawner=lambda args, log, env: self._start("engine", args, log, env),
            )
        for i, server in enumerate(servers):
            name = f"engine{i}"
            self.procs[name] = server.proc
            self._cmds[name] = (launch_command(server.spec), python_env(server.spec.env))
            self._urls[name] = server.url
            self._hosts[name] = server.spec.host
        return urls

    def start_trainers(self, args: TrainerArgs) -> None:
        self._start_fork_server(args.model_path)
        host = self.cfg.weights.master_address
        port = free_port(host)
        for r in range(args.world_size):
            name = f"trainer{r}"
            self._cmds[name] = (trainer_command(args, r, host, host, port), python_env())
            self._hosts[name] = host
            self._spawn(name)

    def deaths(self) -> list[Death]:
        out = []
        for name, p in self.procs.items():
            if name not in self._reported and p.poll() is not None:
                self._reported.add(name)
                out.append(Death(name, p.returncode, log_tail(self.run_dir / f"{name}.log")))
        return out

    def restart(self, name: str) -> str:
        if name not in self._cmds:
            raise ValueError(f"no process named {name!r} in this run ({sorted(self._cmds)})")
        old = self.procs.get(name)
        if old is not None:
            stop([old], 5.0)
        self._spawn(name)
        self._reported.discard(name)
        return self._urls.get(name, "")

    def processes(self) -> dict[str, Placed]:
        out = {
            name: Placed(p.pid, self._hosts[name], True)
            for name, p in self.procs.items()
            if p.poll() is None
        }
        fs = self.fork_server
        if fs is not None and fs.proc is not None and fs.alive():  # ours, not a shared one
            out["forkserver"] = Placed(fs.proc.pid, "127.0.0.1", True)
        return out

    def stop(self, trainer_grace_s: float = 0.0) -> None:
        self._reported.update(self.procs)  # exits from here on are ours
        trainers = [p for name, p in self.procs.items() if name.startswith("trainer")]
        if trainer_grace_s > 0 and trainers:
            wait_exit(trainers, trainer_grace_s)
        stop(list(self.procs.values()), 5.0)
        if self.fork_server is not None:
            self.fork_server.close()

    def _spawn(self, name: str) -> None:
        args, env = self._cmds[name]
        role = "engine" if name.startswith("engine") else "trainer"
        self.procs[name] = self._start(role, args, self.run_dir / f"{name}.log", env)

    def _start(self, role: str, args: Sequence[str], log: Path | None, env: dict[str, str]) -> Proc:
        """Fork ``args`` from the fork server when they run a module it preloads (a trainer
        rank, an embedded engine), else start a fresh process."""
        fs = self.fork_server
        if fs is not None and fs.serves(args) and args[1] in self._forked and fs.alive():
            try:
                return fs.spawn(args, log, env, self.pin.get(role))
            except RuntimeError as exc:  # e.g. a preload failed: start fresh processes
                log_.warning("%s; starting processes without it", exc)
                self.fork_server = None
                fs.close()
        with _pinned(self.pin.get(role)):
            return spawn(args, log, env=env)

    def _start_fork_server(self, model_path: str) -> None:
        """Start the fork server (``cluster.fork_server``), preloading what the trainer and
        the embedded engine import and the model's class."""
        if self.fork_server is not None or not fork_server_wanted(self.cfg):
            return
        if os.environ.get(ENV_SHARED):  # a server shared by several runs (sweeps, tests)
            try:
                self.fork_server = ForkServer.connect(os.environ[ENV_SHARED])
                return
            except OSError as exc:
                log_.warning("%s; this run starts its own", exc)
        preload = list(self._forked)
        model = model_module(model_path)
        preload += [model] if model else []
        self.fork_server = ForkServer.start(preload, self.run_dir / "forkserver.log")


def fork_server_wanted(cfg: RunConfig) -> bool:
    """``cluster.fork_server``: on, off, or (auto) on when no process of the run uses CUDA."""
    mode = cfg.cluster.fork_server
    if mode != "auto":
        return mode == "on"
    # a family whose servers the fork server cannot start (SGLang, vLLM: other programs)
    # counts as CPU here; the embedded engine on a GPU does not
    rollout = family(cfg.rollout)
    engine_cpu = not rollout.preload or rollout.gpus(cfg.rollout) == 0
    return cfg.trainer.device == "cpu" and engine_cpu


@contextlib.contextmanager
def _pinned(cores: set[int] | None) -> Iterator[None]:
    """Children started inside inherit this thread's CPU affinity ``cores`` (Linux)."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
