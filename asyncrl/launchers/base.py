"""The launcher seam: where the processes of a run live, and how the run learns they died.

A run has two kinds of child process, each a ``python -m`` module with its own log
file: rollout engines (HTTP servers, SGLang protocol) and trainer ranks. A
:class:`Launcher` starts them, reports their deaths, restarts one, and ends them
all. It also tells the driver which address to bind what it serves (the
experience channel): loopback for local children, the node's address on a
cluster. Every address a process needs is filled in by the launcher (discovered
where the process runs), never assumed to be loopback.

Implementations: ``local`` (child processes of ``asyncrl run``) and ``ray`` (the
same processes inside thin Ray actors). :func:`asyncrl.launchers.make_launcher`
is the one factory. Nothing here imports torch or ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from asyncrl.controllers.deaths import Death

__all__ = ["Death", "Launcher", "Placed", "TrainerArgs", "log_tail", "trainer_command"]


@dataclass(frozen=True)
class Placed:
    """Where a live process of the run is."""

    pid: int
    """Its process id on its node."""
    address: str
    """The address of its node (what it binds and advertises)."""
    here: bool
    """It runs on the driver's host (its pid means something in this /proc)."""


@dataclass(frozen=True)
class TrainerArgs:
    """What every trainer rank is started with (the launcher adds rank and addresses)."""

    config_path: Path
    model_path: str
    world_size: int
    batch_endpoint: str
    engine_urls: tuple[str, ...]
    resume_file: str = ""
    """JSON ``{"trainer": DIR}`` each rank reads when it starts (a restart included): restore
    that checkpoint first ("" or no file: start from the model)."""


@runtime_checkable
class Launcher(Protocol):
    """Starts, watches, restarts and stops the processes of one run.

    Contract: ``start_engines`` returns one URL per engine (``engine0`` first) once
    every engine process is started (not yet answering: the caller waits with
    :meth:`SGLangClient.wait_healthy`);
    ``start_trainers`` starts ``world_size`` ranks whose rendezvous and weight-sync
    master address are trainer rank 0's advertised address; ``deaths`` returns each
    unexpected exit once (never the exits that ``stop`` causes); ``restart(name)``
    starts that process again with the same arguments and returns its URL (engines;
    it may differ from the old one on a cluster) or ``""`` (trainers); ``stop`` is
    idempotent and leaves no process of the run behind.
    """

    def advertise_host(self) -> str:
        """The address the driver binds what it serves to the run's processes."""
        ...

    def prepare(self, model_path: str) -> None:
        """Start, before anything else of the run, what makes its processes start faster
        (the local launcher's fork server); may do nothing."""
        ...

    def start_engines(self, model_path: str) -> list[str]:
        """Start ``rollout.num_engines`` engine servers; their URLs, in order."""
        ...

    def start_trainers(self, args: TrainerArgs) -> None:
        """Start ``args.world_size`` trainer ranks."""
        ...

    def deaths(self) -> list[Death]:
        """Processes that exited since the last call (each reported once)."""
        ...

    def restart(self, name: str) -> str:
        """Start process ``name`` again; its new URL (engines) or ``""`` (trainers)."""
        ...

    def processes(self) -> dict[str, Placed]:
        """Every live process by name: its pid and node."""
        ...

    def stop(self, trainer_grace_s: float = 0.0) -> None:
        """End every process: trainers may exit on their own within ``trainer_grace_s``
        (they leave the weight group while engines still answer), then SIGTERM, then
        SIGKILL. Returns once all are gone."""
        ...


def trainer_command(
    args: TrainerArgs, rank: int, host: str, dist_addr: str, dist_port: int
) -> list[str]:
    """The interpreter arguments (after ``python``) of trainer rank ``rank``.

    ``host`` is the address this rank advertises (its weight-sync master address when it is
    rank 0, its Gloo address); ``dist_addr:dist_port`` is rank 0's rendezvous.
    """
    cmd = ["-m", "asyncrl.entrypoints.trainer", "--config", str(args.config_path)]
    cmd += ["--model-path", args.model_path, "--rank", str(rank)]
    cmd += ["--world-size", str(args.world_size), "--host", host]
    cmd += ["--dist-addr", dist_addr, "--dist-port", str(dist_port)]
    cmd += ["--batch-endpoint", args.batch_endpoint, "--engine-urls", ",".join(args.engine_urls)]
    if args.resume_file:
        cmd += ["--resume-file", args.resume_file]
    return cmd


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file (or ``(no log)``)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
