"""Where the processes of a run live (``local`` child processes).

:func:`make_launcher` is the one factory of the seam (see ``base`` for the contract).
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.config import RunConfig
from asyncrl.launchers.base import Death, Launcher, TrainerArgs

__all__ = ["Death", "Launcher", "TrainerArgs", "make_launcher"]


def make_launcher(
    cfg: RunConfig, run_dir: Path, pin: dict[str, set[int]] | None = None
) -> Launcher:
    """The launcher ``cfg.cluster.backend`` names.

    ``pin`` (local only) maps ``"engine"`` / ``"trainer"`` to the CPU cores their processes
    get.
    """
    from asyncrl.launchers.local import LocalLauncher

    return LocalLauncher(cfg, run_dir, pin)
