"""An episode's engine calls and their record: the lower half of the agent-loop API.

Contract: :class:`EngineCalls` (the base of
:class:`~asyncrl.controllers.episode.EpisodeContext`) completes token ids on the rollout
engines through the controller's :class:`~asyncrl.controllers.router.Router`, as
``asyncrl.controllers.episode`` describes: an aborted request resubmitted to the same
engine with its tokens kept, a failed one retried elsewhere after a bounded back-off
(:class:`EpisodeFailed` past ``controller.max_retries``; :class:`EngineKeyRefused` at once
for a 401), an outage waited out. Every token keeps the version that produced it
(:class:`Generation`). Every call is journaled (``journal``, and ``current`` while in
progress) and answered from ``replay`` on resume. :class:`Gate` is what the controller and
every episode share: held requests during a ``wait`` pause, the calls in flight, the
retry back-off, a LoRA run's adapter names.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from asyncrl import secret
from asyncrl.config import DEFAULT_MAX_NEW_TOKENS
from asyncrl.controllers.adapters import AdapterNames
from asyncrl.core import GenerateResult, Trajectory
from asyncrl.engines.rollout.base import EngineBadRequest, EngineError, EngineUnavailable

if TYPE_CHECKING:
    from asyncrl.controllers.router import Router

__all__ = ["EngineCalls", "EngineKeyRefused", "EpisodeFailed", "Gate", "Generation", "input_crc"]

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


class EngineCalls:
    """An episode's ``generate`` calls: exact per-token versions, retries, the journal (and
    ``made``: the trajectories built from them)."""

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
        self.journal: list[tuple[list[int], Generation]] = []  # finished calls: (input, output)
        self.current: tuple[list[int], Generation] | None = None  # the call in progress
        self.replay: list[Generation] = []  # calls to answer from a checkpoint, in order
        # the trajectories built from these calls, with the oldest version of their
        # generated tokens (EpisodeContext.trajectory, the gateway's sessions)
        self.made: list[tuple[Trajectory, int]] = []

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
        """Complete ``prefix`` into ``out`` within ``budget`` tokens: engine calls until one
        finishes, an aborted one resubmitted with its tokens kept, a failed one retried
        (:meth:`_after_failure`)."""
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
            await self._wait_to_send()
            ids = prefix + out.output_ids if done else prefix
            try:
                res, applied = await self._send(ids, params, rid, out, on_tokens, pinned)
            except EngineBadRequest as exc:  # the request is wrong: no engine would take it
                self._router.report_failure(self._engine, exc)
                if exc.status == 401:
                    url = getattr(self._engine, "url", "?")
                    raise EngineKeyRefused(f"{secret.refused(url)} ({exc})") from exc
                raise EpisodeFailed(f"episode {self.episode_id}: {exc}") from exc
            except (EngineError, EngineUnavailable) as exc:
                failures = await self._after_failure(exc, failures)
                continue
            if _apply(out, res, applied, pinned, budget):
                return out
            if not res.output_ids:  # aborted before any progress: do not spin against a pause
                await asyncio.sleep(gate.retry_backoff_s)

    async def _wait_to_send(self) -> None:
        """Hold while the gate is closed (a ``wait`` pause), and while no engine is in
        rotation (an outage, not counted as a failure; :class:`EpisodeFailed` once
        ``controller.outage_timeout_s`` passed without one)."""
        if not self._gate.open.is_set():
            await self._gate.open.wait()
        if self._engine is None and not self._router.healthy():
            try:
                await self._router.in_rotation()
            except EngineUnavailable as exc:
                raise EpisodeFailed(f"episode {self.episode_id}: {exc}") from exc

    async def _send(
        self,
        ids: list[int],
        params: dict[str, Any],
        rid: str,
        out: Generation,
        on_tokens: Callable[[], None] | None,
        pinned: int | None,
    ) -> tuple[GenerateResult, int]:
        """One engine call (on the episode's engine, picked when it has none), counted in the
        gate's ``inflight``; returns its result and how many of its tokens were applied to
        ``out`` already (a stream applies them as they arrive)."""
        gate = self._gate
        gate.inflight += 1
        gate.drained.clear()
        try:
            if self._engine is None:
                router = self._router
                if len(router.engines) == 1 and not router.unhealthy and not router.held:
                    self._engine = router.engines[0]  # the common case, without pick()
                else:
                    self._engine = router.pick()
            if on_tokens is None:
                return await self._router.call(self._engine, ids, params, rid), 0
            return await self._streamed(ids, params, rid, out, on_tokens, pinned)
        finally:
            gate.inflight -= 1
            if gate.inflight == 0:
                gate.drained.set()

    async def _after_failure(self, exc: EngineError | EngineUnavailable, failures: int) -> int:
        """An engine error or timeout: report it, then (unless no engine is left in rotation,
        which the next turn waits for) count it, raise :class:`EpisodeFailed` past
        ``max_retries``, move to another engine and back off. Returns the failure count."""
        failed, self._engine = self._engine, None
        self._router.report_failure(failed, exc)
        if not self._router.healthy():
            return failures  # no engine left in rotation: wait for one (the next turn)
        failures += 1
        if failures > self._max_retries:
            raise EpisodeFailed(f"episode {self.episode_id}: {exc}") from exc
        self._engine = _other_engine(self._router, failed)
        backoff = self._gate.retry_backoff_s * 2 ** (failures - 1)
        await asyncio.sleep(min(self._gate.retry_backoff_max_s, backoff))
        return failures

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


def _apply(
    out: Generation, res: GenerateResult, applied: int, pinned: int | None, budget: int
) -> bool:
    """Add one engine call's result to ``out`` (its first ``applied`` tokens are there
    already); True when the completion is finished (not aborted, or its budget used up)."""
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
        return True
    return False


def _other_engine(router: Router, failed: Any) -> Any:
    """The least-loaded engine in rotation other than ``failed`` (None: let pick() decide)."""
    others = [e for e in router.healthy() if e is not failed]
    if not others:
        return None  # only the failed one (or none) is left: pick again after the back-off
    return min(others, key=lambda e: router.outstanding[id(e)])
