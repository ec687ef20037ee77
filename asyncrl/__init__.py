"""asyncrl: fully-asynchronous RL for language models.

Public entry points: :class:`Controller` (embed the pipeline in your own agent
loop: episodes get an :class:`EpisodeContext` and a :class:`Sample`, return a
:class:`Trajectory`; ``next_batch()`` hands out a :class:`Batch`, then raises
:class:`NoMoreSamples` after ``end_input()``; :class:`WeightPusher` brings your
trainer's weights into the engines), :class:`RunConfig` / :func:`load_config`, and
the ``asyncrl`` CLI. README's "Embedding the controller" is ``examples/embedding.py``.
Beside them (:mod:`asyncrl.embedding`): :class:`EngineProcess` (an embedded engine as a
child process on a free port), :func:`wait_healthy` (wait until engines answer, with this
process's run secret), :func:`ensure_tiny_model` and :data:`TINY_VOCAB` (the tiny default
model), and the errors :class:`EngineUnavailable` / :class:`EngineKeyRefused`.
Importing this package never imports torch, and imports each public name only when
it is first used (``from asyncrl import Controller`` works as usual): the engine and
trainer processes import ``asyncrl.*`` modules without loading the controller.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.config import RunConfig, load_config
    from asyncrl.controllers.controller import Controller, NoMoreSamples
    from asyncrl.controllers.episode import (
        EngineKeyRefused,
        EpisodeContext,
        EpisodeFailed,
        Generation,
        RewardError,
    )
    from asyncrl.core import Batch, Sample, Trajectory
    from asyncrl.embedding import TINY_VOCAB, EngineProcess, ensure_tiny_model, wait_healthy
    from asyncrl.engines.rollout.base import EngineUnavailable
    from asyncrl.pusher import WeightPusher
    from asyncrl.transports.weights.base import WeightSyncError

__all__ = [
    "TINY_VOCAB",
    "Batch",
    "Controller",
    "EngineKeyRefused",
    "EngineProcess",
    "EngineUnavailable",
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
    "ensure_tiny_model",
    "load_config",
    "wait_healthy",
]
__version__ = "0.1.0"

_HOMES = {
    "TINY_VOCAB": "asyncrl.embedding",
    "Batch": "asyncrl.core",
    "Controller": "asyncrl.controllers.controller",
    "EngineKeyRefused": "asyncrl.controllers.episode",
    "EngineProcess": "asyncrl.embedding",
    "EngineUnavailable": "asyncrl.engines.rollout.base",
    "EpisodeContext": "asyncrl.controllers.episode",
    "EpisodeFailed": "asyncrl.controllers.episode",
    "Generation": "asyncrl.controllers.episode",
    "NoMoreSamples": "asyncrl.controllers.controller",
    "RewardError": "asyncrl.controllers.episode",
    "RunConfig": "asyncrl.config",
    "Sample": "asyncrl.core",
    "Trajectory": "asyncrl.core",
    "WeightPusher": "asyncrl.pusher",
    "WeightSyncError": "asyncrl.transports.weights.base",
    "ensure_tiny_model": "asyncrl.embedding",
    "load_config": "asyncrl.config",
    "wait_healthy": "asyncrl.embedding",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
