"""asyncrl: fully-asynchronous RL for language models.

Public entry points: :class:`Controller` (embed the pipeline in your own agent
loop), :class:`RunConfig` / :func:`load_config`, and the ``asyncrl`` CLI.
Importing this package never imports torch.
"""

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
