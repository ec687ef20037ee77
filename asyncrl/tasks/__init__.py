"""Built-in tasks: prompt streams with verifiable rewards. No torch import here."""

from asyncrl.tasks.base import Task, make_task

__all__ = ["Task", "make_task"]
