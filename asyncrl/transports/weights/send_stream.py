"""Delivering one push's buckets to the engines (trainer process): :class:`BucketStream`.

A push is delivered in attempts (engines that load buckets as they arrive, SGLang and
vLLM, get a failed push again from the staged copy, as a whole new round:
``weights.repush_attempts``); an attempt is
[pause] begin sessions, the buckets, end sessions, commit [resume] (see ``send_engines``).
The buckets of one attempt are pipelined, on the sender's loop:

1. a packer thread packs bucket after bucket into the staging slots
   (``BucketStager.pack``), running ahead of the sends as far as the slots allow;
2. each packed bucket is *announced* (its control call to every engine starts, ahead
   of its data, so engines queue the receives in order) and its data *transferred*
   (posted; the next bucket may start right behind it) through the transport's
   :class:`BucketLink`; the stream moves on as soon as slot k may be reused;
3. once every bucket is packed and the buckets sent from the caller's tensors have left,
   the snapshot event is set (the trainer may step its optimizer);
4. :meth:`BucketStream.check_acks`: every engine answered every bucket, each within the
   push's budget (``weights.timeout_s`` per GiB moved so far).

Any failure raises :class:`WeightSyncError` naming the bucket (and the engines), and marks
the engine group broken when the group may be out of step.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import torch

from asyncrl import trace
from asyncrl.transports.weights.base import EnginesLeft, WeightsUndefined, WeightSyncError
from asyncrl.transports.weights.bucket import BucketManifest
from asyncrl.transports.weights.seam import EngineError, EngineUnavailable
from asyncrl.transports.weights.send_digests import DigestCheck, pushed_tensors
from asyncrl.transports.weights.send_engines import EngineGroup
from asyncrl.transports.weights.send_staging import BucketStager, Packed

__all__ = ["Acks", "BucketLink", "BucketStream"]

log = logging.getLogger("asyncrl.weights")

Acks = list[tuple[str, "asyncio.Task[Any]"]]
"""Each engine's answer to a bucket's control call: (engine URL, its task), in order."""


class BucketLink(Protocol):
    """How a transport moves one bucket (called on the sender's loop, in bucket order)."""

    def announce(self, m: BucketManifest) -> Acks:
        """Start bucket ``m``'s control call to every engine; it may run ahead of the data
        (engines queue announced buckets and receive them in bucket order)."""
        ...

    async def transfer(
        self, m: BucketManifest, flat: torch.Tensor, acks: Acks, deadline: tuple[float, float]
    ) -> asyncio.Future[None]:
        """Start moving bucket ``m``'s data and return at once (the next bucket may start right
        behind it); the result completes once ``flat`` may be overwritten, and fails when
        the send is not done by ``deadline`` (loop time, budget in seconds)."""
        ...


@dataclass(frozen=True)
class Push:
    """One push as the sender hands it to the group's loop: the trainer's ``tensors`` (by HF
    name) as version ``version``; ``snap`` is set once every tensor was read (the trainer may
    write them again); ``t_push`` when the push was asked for (``perf_counter``); ``packed``:
    the buckets already packed (a snapshot push), else None (packed while sending)."""

    tensors: dict[str, torch.Tensor]
    version: int
    snap: threading.Event
    t_push: float
    packed: list[Packed] | None = None


class BucketStream:
    """Streams the packed buckets of one push through a :class:`BucketLink`."""

    def __init__(self, group: EngineGroup, stager: BucketStager, link: BucketLink):
        self.group = group
        self.stager = stager
        self.link = link
        # SGLang: the last attempt's buckets, in order (a re-push resends them); kept for no
        # other engine (a delta push's payloads are freed once it is delivered)
        self.packed: list[Packed] = []
        self.snap_at = 0.0  # when the last attempt had read every pushed tensor
        self.t_stream = 0.0  # loop time the attempt under way started
        self._packer = ThreadPoolExecutor(1, thread_name_prefix="weight-pack")
        self._started = False  # the attempt under way has sent something to an engine
        self._left_undefined: WeightsUndefined | None = None  # sticky: no push after it
        family, mode = group.family, stager.cfg.verify
        # engines that report their tensors' digests (vLLM): compared after each push with the
        # staged copy (they load live: every bucket's staged copy is kept for a re-push)
        compare = family.compare_digests
        self.digest = None
        if family.loads_live and compare is not None:
            self.digest = DigestCheck(mode, family.digests, compare)

    def close(self) -> None:
        self._packer.shutdown(wait=False)

    def deadline(self, k: int) -> tuple[float, float]:
        """(event-loop time, budget s) by which buckets 0..k must have been sent."""
        upto = self.stager.upto
        budget = self.stager.budget_s(upto[k] if k < len(upto) else 0)
        return self.t_stream + budget, budget

    async def deliver(self, push: Push) -> tuple[list[BucketManifest], int]:
        """Deliver one push (called holding the group's lock): attempts until one delivers
        (engines that load live: up to ``1 + repush_attempts``; an attempt that engines left
        before anything was sent does not count); the plan delivered and the attempts it took.

        Raises :class:`WeightsUndefined` once such engines were left undefined, and
        for every push after that (fatal: the engines stay as they are)."""
        if self._left_undefined is not None:
            raise WeightsUndefined(f"v{push.version} not pushed: {self._left_undefined}")
        group = self.group
        attempts = 1 + (self.stager.cfg.repush_attempts if group.loads_live else 0)
        attempt = 0
        while True:
            self._started = False  # (also when it is cancelled before it ran)
            try:
                job = self._attempt(push, attempt)
                return await group.guarded(job), attempt + 1
            except WeightSyncError as exc:
                if isinstance(exc, EnginesLeft) and not self._started:
                    log.warning("v%d: %s; pushing to %s", push.version, exc, group.urls)
                    continue  # nothing of it sent yet: the engines left get it
                if isinstance(exc, WeightsUndefined):  # fatal as it is (nothing to re-send)
                    self._left_undefined = exc
                    raise
                if attempt == attempts - 1:
                    if group.loads_live:
                        self._left_undefined = self._undefined(push.version, attempts, exc)
                        raise self._left_undefined from exc
                    raise
                log.warning(
                    "v%d: re-pushing (%s weights undefined): %s",
                    push.version,
                    group.family.name,
                    exc,
                )
                attempt += 1

    async def _attempt(self, push: Push, attempt: int) -> list[BucketManifest]:
        """One delivery of a push, the group formed first when it is not (a failed push broke
        it, or the engine set changed); the plan it delivered. ``_started`` tells whether
        anything of it reached an engine."""
        self._started = False
        if not self.group.formed:
            await self.group.reform_locked()
        plan = self.stager.plan_for(push.tensors)
        if push.packed is None and not attempt:
            self.stager.decide_delta()
        self.snap_at = push.t_push
        redo = self.packed if attempt and len(self.packed) == len(plan) else None
        self._started = True
        await self._deliver(plan, push, redo or push.packed)
        return plan

    async def _deliver(
        self, plan: list[BucketManifest], push: Push, packed: list[Packed] | None
    ) -> None:
        """One attempt: [pause] begin, buckets, end, relabel [resume]. Engines that load live
        stay paused when it fails (their weights are undefined until a re-push lands)."""
        group = self.group
        paused = group.pause_scope == "transfer"
        if paused:
            await group.pause()
        ok = False
        try:
            await group.begin_sessions()
            try:
                acks = await self.stream(plan, push.tensors, push.version, push.snap, packed)
                await self.check_acks(acks)
            except BaseException:
                await group.end_sessions()  # without a version: these weights are not it
                raise
            await group.end_sessions(push.version)
            if self.digest is not None:
                await self.digest.check(push.version, group.clients, pushed_tensors(self.packed))
            await group.commit(push.version)
            ok = True
        finally:
            if paused and (ok or not group.loads_live):
                await group.resume()

    def _undefined(self, version: int, attempts: int, exc: BaseException) -> WeightsUndefined:
        urls = ", ".join(c.url for c in self.group.clients) or ", ".join(self.group.urls)
        return WeightsUndefined(
            f"weight push v{version} failed {attempts} time(s); the weights of "
            f"{self.group.family.name} engine(s) {urls} are now UNDEFINED (they load each "
            f"bucket into the live model as it arrives, so a push that fails part-way leaves "
            f"a mix of versions); they are left paused. Last error: {exc}"
        )

    async def stream(
        self,
        plan: list[BucketManifest],
        tensors: dict[str, torch.Tensor],
        version: int,
        snap: threading.Event,
        prepacked: list[Packed] | None = None,
    ) -> Acks:
        """Pack (or take ``prepacked``), announce and transfer every bucket of ``plan``;
        returns every engine's answer to every bucket (not awaited: see ``check_acks``)."""
        loop = asyncio.get_running_loop()
        self.t_stream = loop.time()
        n, depth = len(plan), self.stager.depth
        self.stager.in_place = set()
        self.packed = []
        packed: list[asyncio.Future[Any]] = [loop.create_future() for _ in plan]
        sent: list[asyncio.Future[None]] = [loop.create_future() for _ in plan]

        async def produce() -> None:  # packs ahead as far as the staging slots allow
            for k in range(n):
                if k >= depth:
                    await sent[k - depth]
                try:
                    if prepacked is not None:
                        item = (
                            msgspec.structs.replace(prepacked[k][0], version=version),
                            (prepacked[k][1]),
                        )
                    else:
                        item = await loop.run_in_executor(
                            self._packer, self.stager.pack_traced, k, tensors, version
                        )
                except (RuntimeError, ValueError, KeyError) as exc:
                    packed[k].set_exception(exc)
                    return
                packed[k].set_result(item)
                if self.group.loads_live:  # kept for a re-push (engines that load live)
                    self.packed.append(item)
            for k in sorted(self.stager.in_place):  # buckets sent from the tensors must have left
                await sent[k]
            self.snap_at = time.perf_counter()
            snap.set()  # every tensor read: the trainer may step its optimizer

        announced: list[asyncio.Future[Acks]] = [loop.create_future() for _ in plan]

        async def announce() -> None:  # control calls run ahead of the data, in bucket order
            for k in range(n):
                m, _ = await packed[k]
                announced[k].set_result(self.link.announce(m))

        producer = asyncio.ensure_future(produce())
        announcer = asyncio.ensure_future(announce())
        moving: list[asyncio.Future[None]] = []
        try:
            acks = await self._send(plan, version, packed, announced, sent, moving)
            await producer
        finally:
            await self._wind_down([producer, announcer, *moving], sent, announced, len(moving) < n)
        return acks

    async def _wind_down(
        self,
        tasks: list[asyncio.Future[Any]],
        sent: list[asyncio.Future[None]],
        announced: list[asyncio.Future[Acks]],
        cut_short: bool,
    ) -> None:
        """End an attempt's tasks (packer, announcer, transfers); when it stopped before
        every bucket was sent (``cut_short``), cancel the control calls still waiting.
        Returns once the packer is idle (it holds no pushed tensor any more)."""
        for f in sent:  # wake the producer; it stops at its next bucket
            if not f.done():
                f.set_result(None)
        for task in tasks:
            if not task.done():
                task.cancel()  # the pack in progress finishes in its thread first
        await asyncio.gather(*tasks, return_exceptions=True)
        pending = [t for f in announced if f.done() for _, t in f.result() if not t.done()]
        if pending and cut_short:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._packer, lambda: None)  # packer idle: tensors released

    async def _send(
        self,
        plan: list[BucketManifest],
        version: int,
        packed: list[asyncio.Future[Any]],
        announced: list[asyncio.Future[Acks]],
        sent: list[asyncio.Future[None]],
        moving: list[asyncio.Future[None]],
    ) -> Acks:
        """Transfer each bucket once packed and announced, in order; then wait until every
        one has left (``moving`` collects the transfers, for the caller to clean up)."""
        acks: Acks = []
        tracer = trace.get()
        per = len(self.group.clients)
        for k in range(len(plan)):
            m, flat = await packed[k]
            acks += await announced[k]
            bad = next((f for f in moving if f.done() and f.exception() is not None), None)
            if bad is not None:
                break  # a bucket failed: stop posting (its error is raised below)
            lane, t_send = tracer.take_lane("weight send"), trace.now_us()
            try:
                done = await self.link.transfer(m, flat, acks[-per:], self.deadline(m.index))
            except (EngineError, EngineUnavailable, RuntimeError, OSError) as exc:
                tracer.free_lane(lane)
                raise self._failed(version, k, exc) from exc
            done.add_done_callback(functools.partial(_resolve, sent[k]))
            done.add_done_callback(functools.partial(_traced_send, tracer, lane, k, t_send))
            moving.append(done)
        for k, done in enumerate(moving):  # in order: the first failure is reported
            try:
                await done
            except (EngineError, EngineUnavailable, RuntimeError, OSError) as exc:
                raise self._failed(version, k, exc) from exc
        return acks

    def _failed(self, version: int, k: int, exc: BaseException) -> WeightSyncError:
        self.group.formed = False  # the group may be out of step: re-form next time
        return WeightSyncError(f"v{version} bucket {k} ({self.group.kept}): {exc}")

    async def check_acks(self, acks: Acks) -> None:
        """Every engine's answer to every bucket, each within the push's budget (an engine
        that stopped reading is named with the first bucket it did not answer)."""
        loop = asyncio.get_running_loop()
        deadline, budget = self.deadline(len(self.stager.upto) - 1)
        tasks = [t for _, t in acks]
        per = max(1, len(self.group.clients))
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
            if late:
                first: dict[str, int] = {}
                for i, (u, t) in enumerate(acks):
                    if t in late:
                        first.setdefault(u, i // per)
                        t.cancel()
                await asyncio.gather(*late, return_exceptions=True)
                self.group.formed = False
                names = "; ".join(f"{u}: no answer to bucket {k}" for u, k in first.items())
                raise WeightSyncError(
                    f"{len(first)} engine(s) did not answer within {budget:.1f}s "
                    f"(weights.timeout_s per GiB; {self.group.kept}): {names}"
                )
        results = await asyncio.gather(*tasks, return_exceptions=True)  # all done by now
        named = [
            (f"{u} (bucket {i // per})", r)
            for i, ((u, _), r) in enumerate(zip(acks, results, strict=True))
        ]
        last = (len(acks) - 1) // per
        if any(isinstance(r, BaseException) and i // per < last for i, r in enumerate(results)):
            # the engine skipped the later buckets' broadcasts, which may have completed on
            # our side all the same (buffered): the group is out of step, re-form it
            self.group.formed = False
        self.group.raise_failed(named)


def _resolve(fut: asyncio.Future[None], _: object) -> None:
    """Done-callback: complete ``fut`` unless it already is."""
    if not fut.done():
        fut.set_result(None)


def _traced_send(tracer: trace.Tracer, lane: str, k: int, t0: float, _: object = None) -> None:
    tracer.complete(f"send bucket {k}", lane, t0, trace.now_us())
    tracer.free_lane(lane)
