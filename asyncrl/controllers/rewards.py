"""The one signature of a reward function, how a given function is called, and its errors.

Used by ``ctx.reward`` (:class:`RewardRunner`, re-exported by
``asyncrl.controllers.episode``) and by ``task.reward_fn``
(``asyncrl.tasks.base.CustomReward``); it lives beside the episode API, below the tasks
that use it. Contract: a reward function is called as :data:`REWARD_SIGNATURE` says, async
ones awaited, sync ones off the event loop unless measured cheap (:class:`RewardRunner`);
one that raises or returns no number raises :class:`RewardError`, which stops the run and
is logged once per distinct error.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = [
    "REWARD_SIGNATURE",
    "RewardError",
    "RewardFn",
    "RewardRunner",
    "call_reward",
    "reward_form",
    "reward_name",
]

log = logging.getLogger(__name__)

RewardFn = Callable[..., "float | Awaitable[float]"]  # fn(sample, response_ids[, *, text])

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


class RewardError(RuntimeError):
    """A reward function raised, or returned no number. The run stops with it (a reward that
    raises is a bug, and training on the samples it did score would hide it): the message
    names the function (dotted), the sample's ``id`` and the line that raised (or what it
    returned). The traceback is logged once per distinct error (function, exception type
    and line: the episodes in flight that hit the same bug add nothing), in
    ``RUN_DIR/controller.log`` under ``asyncrl run``, whose console shows one line."""

    logged: bool = False
    """True when the error (and its traceback) was logged already: the controller then
    reports it without its traceback again."""

    @classmethod
    def of(cls, fn: Callable[..., Any], sample: Any, exc: BaseException) -> RewardError:
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        name = _dotted_name(fn)
        sid = getattr(sample, "id", None)
        err = cls(f"reward function {name} raised {type(exc).__name__}: {exc}{where} "
                  f"(sample id {sid!r})")  # fmt: skip
        _log_once((name, type(exc).__name__, where), err, exc)
        return err

    @classmethod
    def not_a_number(cls, fn: Callable[..., Any], sample: Any, value: Any) -> RewardError:
        """``fn`` returned ``value``, which is no number (None, a string, a list...)."""
        name = _dotted_name(fn)
        err = cls(
            f"reward function {name} returned {value!r:.80} for sample id "
            f"{getattr(sample, 'id', None)!r}: a reward function must return a number (a "
            "float); to reject a sample, return None from the episode instead"
        )
        _log_once((name, "returned", type(value).__name__), err, None)
        return err


_LOGGED: set[tuple[str, str, str]] = set()
"""The distinct reward errors logged so far in this process (at most ``_MAX_LOGGED``)."""
_MAX_LOGGED = 256


def _log_once(key: tuple[str, str, str], err: RewardError, exc: BaseException | None) -> None:
    """Log ``err`` (with ``exc``'s traceback) unless an error with the same ``key`` was; the
    record stays off ``asyncrl run``'s console (``console=False``), whose last line names
    the error."""
    err.logged = True
    if key in _LOGGED or len(_LOGGED) >= _MAX_LOGGED:
        return
    _LOGGED.add(key)
    log.error("%s", err, exc_info=exc, extra={"console": False})


def _dotted_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of a reward function; a task method wrapping a user's function
    (``CustomReward``: ``self.fn``) names the user's."""
    inner = getattr(getattr(fn, "__self__", None), "fn", None)
    return reward_name(inner if callable(inner) else fn)


def _number(value: Any) -> Any:
    """A sync reward function's value (an awaitable here: a sync function returning one)."""
    if inspect.isawaitable(value):
        raise TypeError("the reward function returned an awaitable: make it `async def`")
    return value


class RewardRunner:
    """Calls one reward function: async ones awaited; sync ones inline when cheap, else a thread.

    The first calls (up to 3) of a sync function run in a worker thread, timed
    (calls arriving meanwhile wait for the verdict). Once one took less than
    ``inline_s``, later calls run on the event loop — a thread hop costs ~50 µs,
    more than a cheap reward — and stay timed: a run of inline calls slower than
    ``inline_s`` (not a single preempted one) sends it back to the thread for good.
    """

    __slots__ = ("_probe", "_probes", "_slow", "fn", "inline", "inline_s", "is_async", "takes_text")

    def __init__(self, fn: RewardFn, inline_s: float = 0.0002):
        form = reward_form(fn)
        if form == "legacy":
            raise TypeError(
                f"reward function {_dotted_name(fn)} takes (sample, response_ids, "
                f"response_text), the deprecated form of task.reward_fn; ctx.reward calls "
                f"fn(sample, response_ids): write it as {REWARD_SIGNATURE} and call "
                "ctx.reward(fn, sample, response_ids, text=...) for the text"
            )
        self.takes_text = form == "text"
        self.fn = fn
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - async callable objects
        )
        self.inline_s = inline_s
        self.inline = False
        self._slow = 0.0
        self._probes = 0
        self._probe: asyncio.Future | None = None

    async def __call__(
        self, sample: Any, response_ids: list[int], text: str | None = None
    ) -> float:
        """The reward of ``response_ids`` (``text``: the decoded response, passed to a function
        with a keyword-only ``text``, which then needs it); :class:`RewardError` if the
        function raised."""
        if self.takes_text and text is None:
            raise TypeError(
                f"reward function {_dotted_name(self.fn)} takes `text`: pass the decoded "
                "response, ctx.reward(fn, sample, response_ids, text=...)"
            )
        fn = functools.partial(self.fn, text=text) if self.takes_text else self.fn
        try:
            value = await self._call(fn, sample, response_ids)
        except Exception as exc:  # the user's code: any error, named and re-raised
            raise RewardError.of(self.fn, sample, exc) from exc
        if value is None:
            raise RewardError.not_a_number(self.fn, sample, value)
        try:
            return float(value)
        except (TypeError, ValueError):
            raise RewardError.not_a_number(self.fn, sample, value) from None

    async def _call(self, fn: Callable[..., Any], sample: Any, response_ids: list[int]) -> Any:
        if self.is_async:
            out = fn(sample, response_ids)
            assert inspect.isawaitable(out)
            return await out
        if not self.inline and self._probes < 3 and self.inline_s > 0:
            if self._probe is None or self._probe.done():
                return await self._first(fn, sample, response_ids)
            await asyncio.shield(self._probe)
        if self.inline:
            t0 = time.perf_counter()
            value = fn(sample, response_ids)
            if time.perf_counter() - t0 > self.inline_s:
                self._slow += 1.0  # one preemption is noise; a pattern is a slow function
                if self._slow > 3.0:
                    self.inline = False
                    self.inline_s = 0.0  # never inline again
            elif self._slow:
                self._slow *= 0.9
            return _number(value)
        return _number(await asyncio.to_thread(fn, sample, response_ids))

    async def _first(self, fn: Callable[..., Any], sample: Any, response_ids: list[int]) -> Any:
        self._probes += 1
        self._probe = asyncio.get_running_loop().create_future()
        try:
            value, took = await asyncio.to_thread(_timed, fn, sample, response_ids)
            self.inline = took < self.inline_s
        finally:
            self._probe.set_result(None)
        return _number(value)


def _timed(fn: Callable[..., Any], sample: Any, response_ids: list[int]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    value = fn(sample, response_ids)
    return value, time.perf_counter() - t0


async def call_reward(
    fn: RewardFn, sample: Any, response_ids: list[int], text: str | None = None
) -> float:
    """Run a reward function once: async ones awaited, sync ones in a worker thread."""
    return await RewardRunner(fn, inline_s=0.0)(sample, response_ids, text)
