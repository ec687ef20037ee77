"""asyncrl: fully-asynchronous RL for language models.

Public entry points: :class:`Controller` (embed the pipeline in your own agent
loop: episodes get an :class:`EpisodeContext` and a :class:`Sample`, return a
:class:`Trajectory`; ``next_batch()`` hands out a :class:`Batch`, then raises
:class:`NoMoreSamples` after ``end_input()``; :class:`WeightPusher` brings your
trainer's weights into the engines), :class:`RunConfig` / :func:`load_config`, and
the ``asyncrl`` CLI. README's "Embedding the controller" is ``examples/embedding.py``.
Importing this package never imports torch, and imports each public name only when
it is first used (``from asyncrl import Controller`` works as usual): the engine and
trainer processes import ``asyncrl.*`` modules without loading the controller.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.config import RunConfig, load_config
    from asyncrl.controllers.controller import Batch, Controller, NoMoreSamples
    from asyncrl.controllers.episode import EpisodeContext, EpisodeFailed, Generation, RewardError
    from asyncrl.tasks.base import Sample
    from asyncrl.transports.experience.types import Trajectory
    from asyncrl.transports.weights.base import WeightSyncError
    from asyncrl.transports.weights.pusher_send import WeightPusher

__all__ = [
    "Batch",
    "Controller",
    "EpisodeContext",
    "EpisodeFailed",
    "Generation",
    "NoMoreSamples",
    "RewardError",
    "RunConfig",
    "Sample",
    "Trajectory",
    "WeightPusher",
    "WeightSyncError",
    "load_config",
]
__version__ = "0.1.0"

_HOMES = {
    "Batch": "asyncrl.controllers.controller",
    "Controller": "asyncrl.controllers.controller",
    "EpisodeContext": "asyncrl.controllers.episode",
    "EpisodeFailed": "asyncrl.controllers.episode",
    "Generation": "asyncrl.controllers.episode",
    "NoMoreSamples": "asyncrl.controllers.controller",
    "RewardError": "asyncrl.controllers.episode",
    "RunConfig": "asyncrl.config",
    "Sample": "asyncrl.tasks.base",
    "Trajectory": "asyncrl.transports.experience.types",
    "WeightPusher": "asyncrl.transports.weights.pusher_send",
    "WeightSyncError": "asyncrl.transports.weights.base",
    "load_config": "asyncrl.config",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
