"""The one signature of a reward function, and how a given function is called.

Used by ``ctx.reward`` (:class:`~asyncrl.controllers.episode.RewardRunner`) and by
``task.reward_fn`` (``asyncrl.tasks.base.CustomReward``); it lives beside the episode API,
below the tasks that use it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["REWARD_SIGNATURE", "reward_form", "reward_name"]

REWARD_SIGNATURE = (
    "def fn(sample, response_ids) -> float  (or async def; add a keyword-only `*, text` "
    "parameter to get the decoded response too)"
)
"""The one signature of a reward function, everywhere: ``ctx.reward(fn, ...)``,
``task.reward_fn``, a task's ``reward`` method."""


def reward_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of a function, as messages name it."""
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def reward_form(fn: Callable[..., Any]) -> str:
    """How ``fn`` is called, from its signature: ``"ids"`` (``fn(sample, response_ids)``, the
    one signature, :data:`REWARD_SIGNATURE`), ``"text"`` (the same with a keyword-only
    ``text``: ``fn(sample, response_ids, text=decoded)``) or ``"legacy"`` (the deprecated
    ``fn(sample, response_ids, response_text)``: three positional parameters). TypeError,
    showing the signature to write, for a function none of these can call."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: assume the one form
        return "ids"
    text = sig.parameters.get("text")
    forms: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
        ("ids", (None, []), {}),
        ("legacy", (None, [], ""), {}),
    ]
    if text is not None and text.kind is inspect.Parameter.KEYWORD_ONLY:
        forms.insert(0, ("text", (None, []), {"text": ""}))
    for form, args, kwargs in forms:
        try:
            sig.bind(*args, **kwargs)
        except TypeError:
            continue
        return form
    raise TypeError(
        f"reward function {reward_name(fn)}{sig} cannot be called as fn(sample, "
        f"response_ids): write it as {REWARD_SIGNATURE}"
    )
