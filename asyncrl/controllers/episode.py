"""The agent-loop API: an episode is ``async def episode(ctx, sample) -> Trajectory | ... | None``.

An episode calls ``await ctx.generate(ids)`` any number of times (multi-turn,
tools), interleaves environment tokens (tool output, user turns) that are masked
out of the loss, computes a reward (``await ctx.reward(fn, sample, ids)`` calls
``fn(sample, ids)``, the one reward signature of asyncrl, also that of
``task.reward_fn``: sync functions run off the event loop unless they are measured
cheap, async ones are awaited) and returns ``ctx.trajectory(...)`` — or a list of trajectories, or
None to reject the sample (its group then never trains; the others of the group train
without it). Raising :class:`EpisodeRejected` rejects it the same way, with a cause the
controller names if rejections go on (``controller.max_failed_groups``).

``ctx.generate_stream`` is ``generate`` yielding the completion as it grows (the OpenAI
gateway streams with it); both hide engine interruptions and failures:

- a request that a weight update aborted (``finish_reason == "abort"``) is
  re-submitted to the *same* engine as prompt + tokens generated so far, with
  the remaining ``max_new_tokens`` budget; every token keeps the version the
  engine reported for the call that produced it;
- an engine error or timeout retries the request on another healthy engine
  after a bounded exponential back-off (``controller.retry_backoff_s`` doubling
  up to ``retry_backoff_max_s``); after ``controller.max_retries`` retries the
  episode raises :class:`EpisodeFailed` and its group is reported failed;
- when no engine is in rotation (each restarting, re-syncing or not answering)
  the request waits for one to come back (``Router.in_rotation``, at most
  ``controller.outage_timeout_s``) and is then retried with its tokens kept: an
  outage is no failure of the episode, so a dead engine loses no sample.

Every context keeps a journal of its ``generate`` calls (the call in progress
included, with the tokens received so far). A run checkpoint stores it; on resume
the episode runs again from its start and each ``generate`` call is answered from
the journal (a finished call at once, the interrupted one continued from its kept
tokens), so nothing that was generated is generated again. This asks of an episode
what any resumable agent loop needs: given the same generations it makes the same
calls. A call whose input differs from the journal's ends the replay (logged); the
episode then generates afresh from there.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
import traceback
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from asyncrl import secret
from asyncrl.config import DEFAULT_MAX_NEW_TOKENS
from asyncrl.controllers.adapters import AdapterNames
from asyncrl.controllers.rewards import REWARD_SIGNATURE, reward_form
from asyncrl.core import GenerateResult, Sample, Trajectory
from asyncrl.engines.rollout.base import EngineBadRequest, EngineError, EngineUnavailable

if TYPE_CHECKING:
    from asyncrl.controllers.router import Router

__all__ = [
    "EngineKeyRefused",
    "Episode",
    "EpisodeContext",
    "EpisodeFailed",
    "EpisodeRejected",
    "Gate",
    "Generation",
    "RewardError",
    "RewardRunner",
    "Sample",
    "call_reward",
    "input_crc",
    "single_turn",
]

log = logging.getLogger(__name__)


class Generation(msgspec.Struct, gc=False):
    """One completion, possibly stitched from several engine calls across weight updates.

    ``versions[i]`` is the weight version that produced ``output_ids[i]``;
    ``calls`` counts engine calls (1 unless interrupted or retried).
    """

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    calls: int = 0
    input_crc: int = 0  # set in checkpointed journals only: CRC-32 of the call's input ids


def input_crc(ids: Sequence[int]) -> int:
    """CRC-32 of token ids (int32 bytes): identifies a generate call's input in a journal."""
    return zlib.crc32(np.asarray(ids, np.int32).tobytes())


class EpisodeFailed(RuntimeError):
    """An episode's generation failed after every retry; its group is reported failed."""


class EngineKeyRefused(EpisodeFailed):
    """An engine answered 401: it holds another key than this process's run secret
    (``cluster.secret_file``, docs/security.md). No retry and no other engine mends that,
    so the controller stops at the first one (``next_batch`` raises, naming the engine and
    where this process's secret came from) instead of failing group after group."""


class EpisodeRejected(Exception):
    """Raised by an episode instead of returning None: its sample is rejected, not the run.
    The message is the cause (the gateway's agent episodes: the agent's error or timeout,
    with the sample id); the run stops naming the last one once
    ``controller.max_failed_groups`` groups in a row were failed or rejected."""


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
    fn = inner if callable(inner) else fn
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


EpisodeResult = Trajectory | list[Trajectory] | None
Episode = Callable[["EpisodeContext", Any], Awaitable[EpisodeResult]]
RewardFn = Callable[..., "float | Awaitable[float]"]  # fn(sample, response_ids[, *, text])


class Gate:
    """Shared by the controller and every episode: holds new requests during a ``wait`` pause.

    ``inflight`` counts engine calls in progress; ``drained`` is set whenever it is 0.
    """

    __slots__ = (
        "adapters",
        "drained",
        "inflight",
        "open",
        "retry_backoff_max_s",
        "retry_backoff_s",
    )

    def __init__(self, retry_backoff_s: float = 0.05, retry_backoff_max_s: float = 2.0):
        self.adapters: AdapterNames | None = None  # a LoRA run: the version each request names
        self.open = asyncio.Event()
        self.open.set()
        self.drained = asyncio.Event()
        self.drained.set()
        self.inflight = 0
        self.retry_backoff_s = retry_backoff_s
        self.retry_backoff_max_s = retry_backoff_max_s


def _name_adapter(
    adapters: AdapterNames | None, versions: list[int], params: dict[str, Any]
) -> int | None:
    """A LoRA run: name the request's adapter version in ``params["lora_path"]`` (the
    clients send it as the engine's own field) and return the version, which made every
    token of the answer; None: no adapter named (LoRA off, or version 0: the base model)."""
    if adapters is None:
        return None
    version = adapters.version_for(versions)
    path = adapters.path(version)
    params["lora_path"] = path
    return None if path is None else version


def _versions(res: GenerateResult, pinned: int | None) -> list[int]:
    """Every token's version: the named adapter's (exact by construction), else the engine's."""
    return res.token_versions() if pinned is None else [pinned] * len(res.output_ids)


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


class EpisodeContext:
    """Handed to each episode: generation with exact versions, rewards, trajectory helpers."""

    # one literal tuple: a type checker does not follow ``__slots__ += ...``
    __slots__ = (
        "_engine",
        "_gate",
        "_max_retries",
        "_router",
        "current",
        "episode_id",
        "group_id",
        "journal",
        "made",
        "next_rid",
        "replay",
        "sampling",
    )

    def __init__(
        self,
        router: Router,
        group_id: int,
        episode_id: int,
        sampling: dict[str, Any],
        max_retries: int,
        gate: Gate,
    ):
        self._router = router
        self.group_id = group_id
        self.episode_id = episode_id
        self.sampling = sampling  # shared, read-only: generate() copies before changing it
        self._max_retries = max_retries
        self._gate = gate
        self._engine: Any = None  # sticky: every turn of an episode goes to one engine
        self.next_rid = 0  # request ids are f"{episode_id}-{n}", n never reused
        self.made: list[tuple[Trajectory, int]] = []  # (trajectory, min generated version)
        self.journal: list[tuple[list[int], Generation]] = []  # finished calls: (input, output)
        self.current: tuple[list[int], Generation] | None = None  # the call in progress
        self.replay: list[Generation] = []  # calls to answer from a checkpoint, in order

    async def generate(self, input_ids: Sequence[int], **sampling: Any) -> Generation:
        """Complete ``input_ids``; keyword args override the run's sampling params.

        Raises :class:`EpisodeFailed` when the request failed ``max_retries + 1`` times.
        """
        params = {**self.sampling, **sampling} if sampling else dict(self.sampling)
        budget = int(params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
        prefix = input_ids if isinstance(input_ids, list) else list(input_ids)
        out = self._replayed(prefix) if self.replay else None
        if out is not None and out.finish_reason != "partial":
            self.journal.append((prefix, out))
            return out
        out = out or Generation([], [], [], "length")
        return await self._journaled(prefix, out, params, budget, None)

    async def generate_stream(
        self, input_ids: Sequence[int], **sampling: Any
    ) -> AsyncIterator[Generation]:
        """:meth:`generate`, yielding its :class:`Generation` whenever tokens arrived: one
        object, growing (``finish_reason == "partial"`` until the last yield, which is the
        finished completion). A weight update's abort-and-resubmit and a retry elsewhere
        are invisible: the tokens only grow, each with its own version. Closing the
        iterator early cancels the request (its tokens so far stay in ``journal``).
        Raises :class:`EpisodeFailed` as :meth:`generate`."""
        params = {**self.sampling, **sampling} if sampling else dict(self.sampling)
        budget = int(params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
        prefix = list(input_ids)
        out = self._replayed(prefix) if self.replay else None
        if out is not None and out.finish_reason != "partial":
            self.journal.append((prefix, out))
            yield out
            return
        out = out or Generation([], [], [], "partial")
        out.finish_reason = "partial"
        # one future per wake-up, resolved by new tokens or the call's end: the reader wakes
        # in the loop iteration after the engine's event (no waiter task per event)
        loop = asyncio.get_running_loop()
        wake = [loop.create_future()]

        def changed(_: Any = None) -> None:
            if not wake[0].done():
                wake[0].set_result(None)

        task = asyncio.ensure_future(self._journaled(prefix, out, params, budget, changed))
        task.add_done_callback(changed)
        seen = len(out.output_ids)
        try:
            while not task.done():
                await wake[0]
                wake[0] = loop.create_future()
                if len(out.output_ids) > seen and not task.done():
                    seen = len(out.output_ids)
                    yield out
            yield task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _journaled(
        self,
        prefix: list[int],
        out: Generation,
        params: dict[str, Any],
        budget: int,
        on_tokens: Callable[[], None] | None,
    ) -> Generation:
        self.current = (prefix, out)
        try:
            out = await self._generate(prefix, out, params, budget, on_tokens)
        except asyncio.CancelledError:  # a stream closed early: its tokens so far are kept
            if on_tokens is not None and out.output_ids:
                self.journal.append((prefix, out))
            raise
        finally:
            self.current = None
        self.journal.append((prefix, out))
        return out

    def _replayed(self, prefix: list[int]) -> Generation | None:
        """The journal's answer to this call (finish_reason ``partial``: continue it), or None
        when the call differs from the journal's (the replay ends there)."""
        rec = self.replay.pop(0)
        if rec.input_crc != input_crc(prefix):
            log.warning(
                "episode %d: call %d differs from its checkpointed journal; generating afresh",
                self.episode_id,
                len(self.journal),
            )
            self.replay.clear()
            return None
        gen = Generation(list(rec.output_ids), list(rec.logprobs), list(rec.versions), "")
        gen.finish_reason, gen.calls = rec.finish_reason, rec.calls
        return gen

    async def _generate(
        self,
        prefix: list[int],
        out: Generation,
        params: dict[str, Any],
        budget: int,
        on_tokens: Callable[[], None] | None = None,
    ) -> Generation:
        failures = 0
        gate = self._gate
        while True:
            done = len(out.output_ids)
            params["max_new_tokens"] = budget - done
            # prefix-free: SGLang aborts every rid that starts with the one named
            # (0.5.23 scheduler.py:5688), so "7-1" would also abort "7-10"
            rid = f"{self.episode_id}-{self.next_rid}."
            self.next_rid += 1
            pinned = _name_adapter(gate.adapters, out.versions, params)
            if not gate.open.is_set():
                await gate.open.wait()
            if self._engine is None and not self._router.healthy():
                try:  # an outage: wait for an engine (not counted as a failure)
                    await self._router.in_rotation()
                except EngineUnavailable as exc:
                    raise EpisodeFailed(f"episode {self.episode_id}: {exc}") from exc
            gate.inflight += 1
            gate.drained.clear()
            try:
                if self._engine is None:
                    router = self._router
                    if len(router.engines) == 1 and not router.unhealthy and not router.held:
                        self._engine = router.engines[0]  # the common case, without pick()
                    else:
                        self._engine = router.pick()
                ids = prefix + out.output_ids if done else prefix
                if on_tokens is None:
                    res, applied = await self._router.call(self._engine, ids, params, rid), 0
                else:
                    res, applied = await self._streamed(ids, params, rid, out, on_tokens, pinned)
            except EngineBadRequest as exc:  # the request is wrong: no engine would take it
                self._router.report_failure(self._engine, exc)
                if exc.status == 401:
                    url = getattr(self._engine, "url", "?")
                    raise EngineKeyRefused(f"{secret.refused(url)} ({exc})") from exc
                raise EpisodeFailed(f"episode {self.episode_id}: {exc}") from exc
            except (EngineError, EngineUnavailable) as exc:
                failed, self._engine = self._engine, None
                self._router.report_failure(failed, exc)
                if not self._router.healthy():
                    continue  # no engine left in rotation: wait for one (top of the loop)
                failures += 1
                if failures > self._max_retries:
                    raise EpisodeFailed(f"episode {self.episode_id}: {exc}") from exc
                self._engine = _other_engine(self._router, failed)
                backoff = gate.retry_backoff_s * 2 ** (failures - 1)
                await asyncio.sleep(min(gate.retry_backoff_max_s, backoff))
                continue
            finally:
                gate.inflight -= 1
                if gate.inflight == 0:
                    gate.drained.set()
            out.calls += 1
            n = len(res.output_ids)
            if n > applied:
                out.output_ids += res.output_ids[applied:] if applied else res.output_ids
                out.logprobs += res.logprobs[applied:] if applied else res.logprobs
                out.versions += _versions(res, pinned)[applied:]
            out.finish_reason = "partial" if res.finish_reason == "abort" else res.finish_reason
            if res.finish_reason != "abort" or len(out.output_ids) >= budget:
                if out.finish_reason == "partial":
                    out.finish_reason = "length"
                return out
            if not n:  # aborted before any progress: do not spin against a paused engine
                await asyncio.sleep(gate.retry_backoff_s)

    async def _streamed(
        self,
        ids: list[int],
        params: dict[str, Any],
        rid: str,
        out: Generation,
        on_tokens: Callable[[], None],
        pinned: int | None = None,
    ) -> tuple[GenerateResult, int]:
        """One streamed engine call: its tokens go into ``out`` as they arrive (kept even if
        the call fails later); returns the final result and how many of its tokens were
        applied."""
        applied = 0
        res: GenerateResult | None = None
        async for res in self._router.stream(self._engine, ids, params, rid):
            n = len(res.output_ids)
            if n > applied:
                out.output_ids += res.output_ids[applied:]
                out.logprobs += res.logprobs[applied:]
                out.versions += _versions(res, pinned)[applied:]
                applied = n
                on_tokens()
        if res is None or not res.finish_reason:
            raise EngineError("/generate", 200, "the stream ended before its final answer")
        return res, applied

    async def reward(
        self,
        fn: RewardFn | RewardRunner,
        sample: Any,
        response_ids: list[int],
        text: str | None = None,
    ) -> float:
        """``fn(sample, response_ids)``, the one reward signature (``REWARD_SIGNATURE``; with
        a keyword-only ``text`` parameter, ``fn(sample, response_ids, text=text)``): async
        functions awaited, sync ones off the event loop. A function of another form is
        refused (TypeError showing the signature to write); one that raises stops the run
        (:class:`RewardError`)."""
        runner = fn if isinstance(fn, RewardRunner) else RewardRunner(fn, inline_s=0.0)
        return await runner(sample, response_ids, text)

    def trajectory(
        self,
        prompt_ids: Sequence[int],
        turns: Sequence[Generation | Sequence[int]],
        reward: float,
        **extra: Any,
    ) -> Trajectory:
        """Build a Trajectory from alternating generations and environment tokens.

        Generated tokens are trained on; environment tokens (plain int sequences)
        are masked out, with log-prob 0 and the version of the turn before them
        (of the turn after them when they come first).
        """
        if len(turns) == 1 and isinstance(turns[0], Generation):  # the common single turn
            g = turns[0]
            ids, lps, vers = g.output_ids, g.logprobs, g.versions
            mask = _ones(len(ids))
            oldest = min(vers) if vers else 0
        else:
            ids, lps, vers, mask_list = _stitch(turns)
            mask = np.asarray(mask_list, np.uint8)
            gens = [t.versions[0] for t in turns if isinstance(t, Generation) and t.versions]
            oldest = min(gens) if gens else (min(vers) if vers else 0)
        if extra and (unknown := sorted(set(extra) - set(Trajectory.__struct_fields__))):
            raise TypeError(
                f"episode {self.episode_id}: ctx.trajectory() got unknown field(s) {unknown}; "
                f"a Trajectory has {', '.join(Trajectory.__struct_fields__)}"
            )
        last = next((t for t in reversed(turns) if isinstance(t, Generation)), None)
        if last is not None and last.finish_reason == "length":  # algo.mask_truncated reads it
            extra["metadata"] = {**extra.get("metadata", {}), "truncated": True}
        traj = Trajectory(
            prompt_ids=np.asarray(prompt_ids, np.int32),
            response_ids=np.asarray(ids, np.int32),
            behav_logprobs=np.asarray(lps, np.float32),
            versions=np.asarray(vers, np.int32),
            loss_mask=mask,
            reward=float(reward),
            group_id=self.group_id,
            episode_id=self.episode_id,
            **extra,
        )
        return self._made(traj, oldest)

    def _made(self, traj: Trajectory, oldest: int) -> Trajectory:
        # Versions only grow over time, so the first generated token is the oldest: a lower
        # bound of the trained tokens' version however the episode edits loss_mask later.
        self.made.append((traj, oldest))
        return traj

    def min_version(self, traj: Trajectory) -> int:
        """Oldest version of ``traj``'s trained tokens (cached when this context built it)."""
        for t, oldest in self.made:
            if t is traj:
                return oldest
        return traj.min_version


def _ones(n: int) -> np.ndarray:
    """A loss mask of n ones, the trajectory's own (writable: a trainer wraps it with
    ``torch.from_numpy`` without a copy or a warning, and may edit it)."""
    return np.ones(n, np.uint8)


def _other_engine(router: Router, failed: Any) -> Any:
    """The least-loaded engine in rotation other than ``failed`` (None: let pick() decide)."""
    others = [e for e in router.healthy() if e is not failed]
    if not others:
        return None  # only the failed one (or none) is left: pick again after the back-off
    return min(others, key=lambda e: router.outstanding[id(e)])


def _stitch(
    turns: Sequence[Generation | Sequence[int]],
) -> tuple[list[int], list[float], list[int], list[int]]:
    first = next((t.versions[0] for t in turns if isinstance(t, Generation) and t.versions), 0)
    ids: list[int] = []
    lps: list[float] = []
    vers: list[int] = []
    mask: list[int] = []
    last_version = first
    for turn in turns:
        if isinstance(turn, Generation):
            ids += turn.output_ids
            lps += turn.logprobs
            vers += turn.versions
            mask += [1] * len(turn.output_ids)
            if turn.versions:
                last_version = turn.versions[-1]
        else:
            env = [int(t) for t in turn]
            ids += env
            lps += [0.0] * len(env)
            vers += [last_version] * len(env)
            mask += [0] * len(env)
    return ids, lps, vers, mask


def single_turn(reward_fn: RewardFn, inline_reward_s: float = 0.0002) -> Episode:
    """The default episode: one generation from the sample's prompt, scored by ``reward_fn``."""
    runner = RewardRunner(reward_fn, inline_reward_s)

    async def episode(ctx: EpisodeContext, sample: Sample) -> Trajectory:
        gen = await ctx.generate(sample.prompt_ids)
        reward = await runner(sample, gen.output_ids)
        return ctx.trajectory(sample.prompt_ids, [gen], reward)

    return episode
