"""asyncrl: fully-asynchronous RL for language models.

Public entry points: :class:`Controller` (embed the pipeline in your own agent
loop), :class:`RunConfig` / :func:`load_config`, and the ``asyncrl`` CLI.
Importing this package never imports torch, and imports each public name only when
it is first used (``from asyncrl import Controller`` works as usual): the engine and
trainer processes import ``asyncrl.*`` modules without loading the controller.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.config import RunConfig, load_config
    from asyncrl.controllers.controller import Controller
    from asyncrl.controllers.episode import EpisodeContext, Generation
    from asyncrl.transports.experience.types import Trajectory

__all__ = [
    "Controller",
    "EpisodeContext",
    "Generation",
    "RunConfig",
    "Trajectory",
    "load_config",
]
__version__ = "0.1.0"

_HOMES = {
    "Controller": "asyncrl.controllers.controller",
    "EpisodeContext": "asyncrl.controllers.episode",
    "Generation": "asyncrl.controllers.episode",
    "RunConfig": "asyncrl.config",
    "Trajectory": "asyncrl.transports.experience.types",
    "load_config": "asyncrl.config",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
