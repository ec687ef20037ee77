"""Where the processes of a run live: ``local`` child processes or ``ray`` actors.

:func:`make_launcher` is the one factory of the seam (see ``base`` for the contract).
Nothing here imports ray unless ``cluster.backend = "ray"``.
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.config import RunConfig
from asyncrl.launchers.base import Death, Launcher, Placed, TrainerArgs

__all__ = ["Death", "Launcher", "Placed", "TrainerArgs", "make_launcher"]


def make_launcher(
    cfg: RunConfig, run_dir: Path, pin: dict[str, set[int]] | None = None
) -> Launcher:
    """The launcher ``cfg.cluster.backend`` names.

    ``pin`` (local only) maps ``"engine"`` / ``"trainer"`` to the CPU cores their processes
    get. Raises ValueError naming what to install when ``ray`` is chosen without Ray.
    """
    if cfg.cluster.backend == "ray":
        from asyncrl.launchers.ray import RayLauncher

        return RayLauncher(cfg, run_dir)
    from asyncrl.launchers.local import LocalLauncher

    return LocalLauncher(cfg, run_dir, pin)
