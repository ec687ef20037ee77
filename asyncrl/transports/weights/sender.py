"""The pipelined bucket sender shared by the collective and CUDA IPC transports.

``push`` only takes references to the tensors; a background thread with its own
asyncio loop does the rest, one push at a time, in order:

1. a packer thread packs bucket after bucket into the staging slots (checksum
   computed there), running ahead of the sends as far as the slots allow
   (``staging_buckets``: 0 = a slot per bucket, so the trainer is released
   after one copy of the weights; 2 = double-buffered, least memory);
2. the sender sends bucket k while k+1 is packed, and moves on as soon as
   slot k may be reused. For collectives the control calls (one per engine,
   concurrent) are announced as soon as a bucket is packed, ahead of its
   broadcast, so engines queue the receives in order and no handshake sits
   between two broadcasts; acks are gathered at the end, so verifying on the
   engines overlaps sending. A bucket within the first ``zero_copy_frac`` of
   the bytes whose tensors already lie back to back in memory (one tensor, or
   a flat parameter buffer) is sent from the tensors themselves (no staging copy);
3. once the last bucket is packed, the snapshot event is set: the trainer may
   step its optimizer (``PushHandle.wait_snapshot``);
4. when every engine acked every bucket (received + checksum verified + names
   and shapes checked), commit on every engine (``/update_weight_version``,
   engines paused only around it when ``pause_scope="commit"``).

Any failure skips the commit: the engines drop what they staged and keep their
weights and version; the push's handle raises :class:`WeightSyncError`.

SGLang engines (``engine="sglang"``) load every bucket into the live model as it
arrives (no staging) and cannot load a chunk of a tensor, so for them the sender
plans whole tensors only, pauses generation for the whole transfer, opens
SGLang's weight-update session around the buckets (0.5.22+), puts
``weight_version`` on the last bucket (SGLang relabels with the load) and
relabels before generation resumes. A failed push leaves their weights
undefined: it is re-pushed from the staged copy (``weights.repush_attempts``
times, engines still paused), and when that fails too the push raises, saying
so, and the engines stay paused. See docs/weight-sync.md, "Per backend".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Coroutine, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec
import torch

from asyncrl import trace
from asyncrl.config import WeightSyncConfig
from asyncrl.engines.rollout.base import EngineError, EngineUnavailable
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.loops import new_event_loop
from asyncrl.transports.weights.base import (
    EnginesLeft,
    PushHandle,
    WeightsUndefined,
    WeightSyncError,
)
from asyncrl.transports.weights.bucket import (
    BucketManifest,
    TensorSpec,
    checksum,
    pack_checksum,
    pack_into,
    plan_buckets,
    span_of,
    spec_of,
)
from asyncrl.transports.weights.delta import DELTA_CAPABILITY, DeltaEncoder, DeltaInfo
from asyncrl.transports.weights.integrity import bucket_checksum, full_checksum

__all__ = ["BucketSender"]

log = logging.getLogger("asyncrl.weights")

Acks = list[tuple[str, "asyncio.Task[Any]"]]
T = TypeVar("T")


class BucketSender:
    """Base of the weight senders: planning, staged packing, acks, commit."""

    zero_copy_ok = False
    """A transport that is done with ``flat`` once its ``_transfer`` result completes may send
    a bucket straight from the caller's memory (see ``_zero_copy``)."""
    delta_ok = False
    """The transport can send delta buckets (``weights.delta``, see ``delta``)."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        cfg: WeightSyncConfig,
        device: str = "cpu",
        pause_mode: str = "abort",
        engine: str = "local",
    ):
        if not engine_urls:
            raise ValueError("weight sync needs at least one engine URL")
        self.urls = list(engine_urls)
        self.cfg = cfg
        self.device = torch.device(device)
        self.pause_mode = pause_mode
        self.sglang = engine == "sglang"
        self.pause_scope = "transfer" if self.sglang else cfg.pause_scope
        self.clients: list[SGLangClient] = []
        self._packed: list[tuple[BucketManifest, torch.Tensor]] = []  # this push's, in order
        self._loop = new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="weight-sender", daemon=True
        )
        self._packer = ThreadPoolExecutor(1, thread_name_prefix="weight-pack")
        self._lock: asyncio.Lock | None = None
        self._formed = False
        self._epoch = 0  # of the newest engine set told (engines_changed)
        self._op: asyncio.Task[Any] | None = None  # the push attempt or re-form under way
        self._left: list[str] = []  # engines it involved that left the set (it was cancelled)
        self._started = False  # the push attempt under way has sent something to an engine
        self._plan_key: tuple[TensorSpec, ...] = ()
        self._plan: list[BucketManifest] = []
        self._slot_bytes: list[int] = []  # staging slot sizes; a slot is allocated on first use
        self._slots: dict[int, torch.Tensor] = {}
        self._zero_copy_upto = 0  # buckets [0, upto) may be sent from the caller's memory
        self._in_place: set[int] = set()  # buckets of the current push sent from it (packer)
        self._last: PushHandle | None = None
        self._snap_at = 0.0
        self._left_undefined: WeightsUndefined | None = None  # sticky: no push after it
        # weights.delta: bases on this side; engines' capability; the version they all hold
        # SGLang loads what it receives (no deltas in 0.5.10-0.5.23): it always gets full pushes,
        # so no base is kept for it
        takes = cfg.delta != "off" and self.delta_ok and not self.sglang
        self._delta = DeltaEncoder(cfg.delta) if takes else None
        self._engines_delta = False
        self._base_version: int | None = None
        self._deltas_in_row = 0
        self._delta_now = False  # the push in flight sends deltas against _base_version
        self._stats: dict[str, float] = {}
        # every wait ends (weights.timeout_s per GiB): bytes up to each bucket, stream start
        self._upto: list[int] = []
        self._t_stream = 0.0

    # -- hooks of a transport ------------------------------------------------------------
    async def _form(self) -> None:
        """Form the transport with every engine in ``self.clients``."""
        raise NotImplementedError

    async def _teardown(self) -> None:
        """Undo ``_form`` (best effort: engines may be gone)."""
        raise NotImplementedError

    def _announce(self, m: BucketManifest) -> Acks:
        """Start bucket ``m``'s control call to every engine; it may run ahead of the data
        (engines queue announced buckets and receive them in bucket order)."""
        raise NotImplementedError

    async def _transfer(
        self, m: BucketManifest, flat: torch.Tensor, acks: Acks
    ) -> asyncio.Future[None]:
        """Start moving bucket ``m``'s data and return at once (the next bucket may start right
        behind it); the result completes once ``flat`` may be overwritten."""
        raise NotImplementedError

    # -- lifecycle -----------------------------------------------------------------------
    def _run(self, coro: Coroutine[Any, Any, Any]) -> Future[Any]:
        if not self._thread.is_alive():
            self._thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def connect(self, engine_urls: Sequence[str] | None = None) -> None:
        """Form the transport (again, with ``engine_urls`` when given, else with the current
        set); blocks until formed."""
        if engine_urls is not None and not engine_urls:
            raise ValueError("weight sync needs at least one engine URL")
        self._run(self._reform(None if engine_urls is None else list(engine_urls))).result()

    def engines_changed(self, engine_urls: Sequence[str], epoch: int) -> None:
        """The run's engine set is now ``engine_urls``, its ``epoch``-th change (see base):
        the next push or re-form uses it; one under way stops waiting on an engine not in
        it. Safe from any thread; returns at once (an older ``epoch`` is ignored)."""
        urls = list(engine_urls)
        if not urls:
            raise ValueError("weight sync needs at least one engine URL")
        self._loop.call_soon_threadsafe(self._set_engines, urls, epoch)

    def _set_engines(self, urls: list[str], epoch: int) -> None:
        """On the sender's loop: take the set (see ``engines_changed``)."""
        if epoch < self._epoch:
            return
        self._epoch = epoch
        if urls == self.urls:
            return
        log.info("engine set %d: %s (was %s)", epoch, urls, self.urls)
        self.urls = urls
        self._formed = False  # the next push forms the group with exactly these engines
        op = self._op
        left = [c.url for c in self.clients if c.url not in urls]
        if left and op is not None and not op.done():
            self._left = left
            op.cancel()

    async def _guarded(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` (a push attempt or a re-form) as the operation under way; when an
        engine it involves leaves the set, it is cancelled and :class:`EnginesLeft` raised
        naming the engine(s), instead of waiting on them (see ``_set_engines``)."""
        task = asyncio.ensure_future(coro)
        self._op, self._left = task, []
        try:
            return await task
        except asyncio.CancelledError:
            outer = getattr(asyncio.current_task(), "cancelling", None)  # Python 3.11+
            if not self._left or not task.cancelled() or (outer is not None and outer()):
                raise  # cancelled from outside (shutdown): not ours to turn into an error
            raise EnginesLeft(self._left, self.urls) from None
        finally:
            self._op = None

    def close(self) -> None:
        if self._last is not None and not self._last.done():
            try:
                self._last.wait(self.cfg.timeout_s)
            except (WeightSyncError, TimeoutError) as exc:
                log.warning("closing with a failed push: %s", exc)
        if self._thread.is_alive():
            try:
                self._run(self._shutdown()).result(timeout=30)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)
        self._packer.shutdown(wait=False)

    async def _reform(self, urls: list[str] | None = None) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if urls is not None:
                self.urls = urls
            while True:  # again only after the set changed (an engine left meanwhile)
                try:
                    await self._guarded(self._reform_locked())
                    return
                except EnginesLeft as exc:
                    log.warning("%s; forming the weight group with %s", exc, self.urls)

    async def _shutdown(self) -> None:
        if self._formed:
            self._formed = False
            await self._teardown()
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
        self.clients = []

    # -- push ----------------------------------------------------------------------------
    def push(self, named_weights: Iterable[tuple[str, torch.Tensor]], version: int) -> PushHandle:
        """Take references to the weights and stream them in the background (see base)."""
        t0 = time.perf_counter()
        tensors = {n: t.detach() for n, t in named_weights}
        if not tensors:
            raise ValueError("push() got no tensors")
        snap = threading.Event()
        packed = None
        if self.cfg.snapshot:  # pack every bucket now: the caller may modify its tensors on return
            if self._last is not None:
                with contextlib.suppress(WeightSyncError):
                    self._last.wait()  # the staging slots are free once the last push is done
            plan = self._plan_for(tensors)
            self._decide_delta()
            packed = [self._pack(k, tensors, version) for k in range(len(plan))]
            snap.set()
        fut = self._run(self._push(tensors, version, snap, t0, packed))
        self._last = PushHandle(version, fut, snap)
        return self._last

    def _plan_for(self, tensors: dict[str, torch.Tensor]) -> list[BucketManifest]:
        sync = self.cfg.dtype
        specs = tuple(
            spec_of(n, t)
            if sync == "auto" or not t.is_floating_point()
            else TensorSpec(n, sync, tuple(t.shape))
            for n, t in tensors.items()
        )
        if specs != self._plan_key:
            self._plan_key = specs
            self._plan = plan_buckets(
                specs, self.cfg.bucket_mb << 20, self.cfg.min_buckets, whole_only=self.sglang
            )
            if self._delta is not None:  # new buckets: no base any more, the next push is full
                self._delta.reset()
                self._base_version = None
            depth = self.cfg.staging_buckets
            if depth == 0 or self.cfg.snapshot or self.sglang or self._delta is not None:
                # SGLang: kept for a re-push; delta: every slot becomes a base
                depth = len(self._plan)
            depth = max(1, min(depth, len(self._plan)))
            total, upto = sum(m.nbytes for m in self._plan), 0
            while (
                upto < len(self._plan)
                and sum(m.nbytes for m in self._plan[: upto + 1]) <= self.cfg.zero_copy_frac * total
            ):
                upto += 1
            self._zero_copy_upto = upto
            self._upto = list(itertools.accumulate(m.nbytes for m in self._plan))
            sizes = [max(m.nbytes for m in self._plan[j::depth]) for j in range(depth)]
            self._slot_bytes, self._slots = sizes, {}
        return self._plan

    def _pack(
        self, k: int, tensors: dict[str, torch.Tensor], version: int
    ) -> tuple[BucketManifest, torch.Tensor]:
        mode = self.cfg.verify
        m = msgspec.structs.replace(self._plan[k], version=version, verify=mode)
        span = self._zero_copy(k, tensors)
        if span is not None:  # send straight from the caller's memory: nothing to copy
            self._in_place.add(k)
            return msgspec.structs.replace(m, checksum=bucket_checksum(span, m, mode)), span
        slot = self._slot(k % len(self._slot_bytes))
        flat = slot[: m.nbytes].view(m.torch_dtype)
        if mode == "full":  # fused: each block summed right after its copy, while in cache
            value: int | None = full_checksum(flat, m, pack_checksum(flat, m, tensors))
        else:
            pack_into(flat, m, tensors)
            value = bucket_checksum(flat, m, mode)
        m = msgspec.structs.replace(m, checksum=value)
        if self._delta is None:
            return m, flat
        return self._delta_of(k, m, slot, flat)

    def _delta_of(
        self, k: int, m: BucketManifest, slot: torch.Tensor, flat: torch.Tensor
    ) -> tuple[BucketManifest, torch.Tensor]:
        """With ``weights.delta``: the packed slot becomes bucket k's base (the old base is the
        next slot) and the bucket goes as a delta payload when this push sends deltas."""
        assert self._delta is not None and slot.numel() == m.nbytes
        old = self._delta.bases.get(k)
        payload, changed = self._delta.take(k, slot, self._delta_now)
        if old is None:
            self._slots.pop(k, None)
        else:
            self._slots[k] = old
        st = self._stats
        st["changed_words"] = st.get("changed_words", 0.0) + max(changed, 0)
        if payload is None:
            st["wire_bytes"] = st.get("wire_bytes", 0.0) + m.nbytes
            return m, flat
        st["wire_bytes"] = st.get("wire_bytes", 0.0) + payload.numel()
        st["delta_buckets"] = st.get("delta_buckets", 0.0) + 1
        value = None if self.cfg.verify == "off" else checksum(payload)
        assert self._base_version is not None
        info = DeltaInfo(self._base_version, payload.numel(), value)
        return msgspec.structs.replace(m, delta=info), payload

    def _budget_s(self, nbytes: int) -> float:
        """How long a wait on ``nbytes`` moved may take: ``timeout_s`` per GiB, at least one."""
        return self.cfg.timeout_s * max(1.0, nbytes / (1 << 30))

    def _deadline(self, k: int) -> tuple[float, float]:
        """(event-loop time, budget s) by which buckets 0..k must have been sent."""
        budget = self._budget_s(self._upto[k] if k < len(self._upto) else 0)
        return self._t_stream + budget, budget

    def _decide_delta(self) -> None:
        """Whether this push sends deltas: only against a version every engine holds (not the
        first push, nor after a (re)connect or a failed push) and not on every
        ``full_every``-th push."""
        every = self.cfg.full_every
        self._delta_now = (
            self._delta is not None
            and self._engines_delta
            and self._base_version is not None
            and (every == 0 or self._deltas_in_row < every - 1)
        )
        self._stats = {}

    def _pack_traced(
        self, k: int, tensors: dict[str, torch.Tensor], version: int
    ) -> tuple[BucketManifest, torch.Tensor]:
        with trace.get().span(f"pack bucket {k}", "weight pack", {"bytes": self._plan[k].nbytes}):
            return self._pack(k, tensors, version)

    def _slot(self, j: int) -> torch.Tensor:
        """Staging slot ``j``, allocated when a bucket is first staged in it: buckets sent in
        place never cost the sender memory (on a GPU the allocator would hold it at once)."""
        slot = self._slots.get(j)
        if slot is None:
            slot = self._slots[j] = torch.empty(
                self._slot_bytes[j], dtype=torch.uint8, device=self.device
            )
        return slot

    def _zero_copy(self, k: int, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Bucket k as one view of the caller's memory, when it may be sent from there.

        Only for transports done with a buffer when its send returns (collectives),
        not in snapshot mode (there the caller may write its tensors once ``push``
        returns), for buckets within the first ``zero_copy_frac`` of the sync's bytes
        (sent early, so the trainer's next optimizer step waits little for them), and
        only when the bucket's entries already lie back to back in one storage in
        manifest order (one whole tensor; or a trainer whose parameters live in one
        flat buffer, see ``trainer.flat_params``). Everything else is staged.
        """
        if not self.zero_copy_ok or self.cfg.snapshot or self.sglang or k >= self._zero_copy_upto:
            return None
        if self._delta is not None:  # the base must be a copy of its own
            return None
        return span_of(self._plan[k], tensors, self.device)

    async def _push(
        self,
        tensors: dict[str, torch.Tensor],
        version: int,
        snap: threading.Event,
        t_push: float,
        packed: list[tuple[BucketManifest, torch.Tensor]] | None = None,
    ) -> dict[str, float]:
        assert self._lock is not None, "connect() first"
        async with self._lock:
            t0 = time.perf_counter()
            attempts = 1 + (self.cfg.repush_attempts if self.sglang else 0)
            try:
                if self._left_undefined is not None:  # fatal: the engines stay as they are
                    raise WeightsUndefined(f"v{version} not pushed: {self._left_undefined}")
                attempt = 0
                while True:
                    self._started = False  # (also when it is cancelled before it ran)
                    try:
                        job = self._attempt(tensors, version, snap, t_push, packed, attempt)
                        plan = await self._guarded(job)
                        break
                    except WeightSyncError as exc:
                        if isinstance(exc, EnginesLeft) and not self._started:
                            log.warning("v%d: %s; pushing to %s", version, exc, self.urls)
                            continue  # nothing of it sent yet: the engines left get it
                        if attempt == attempts - 1:
                            if self.sglang:
                                self._left_undefined = self._undefined(version, attempts, exc)
                                raise self._left_undefined from exc
                            raise
                        log.warning("v%d: re-pushing (SGLang weights undefined): %s", version, exc)
                        attempt += 1
                snap_s = self._snap_at - t_push
            except BaseException:
                self._base_version = None  # engines may hold anything staged: next push is full
                raise
            finally:
                snap.set()
            if self._delta is not None:
                self._base_version = version
                self._deltas_in_row = self._deltas_in_row + 1 if self._delta_now else 0
            nbytes = sum(m.nbytes for m in plan)
            tracer = trace.get()
            t_end = trace.now_us()
            tracer.complete(f"push v{version}", "weight sync", trace.us_of(t0), t_end,
                            {"bytes": nbytes, "buckets": len(plan)})  # fmt: skip
            tracer.complete(f"snapshot v{version}", "weight snapshot", trace.us_of(t_push),
                            trace.us_of(self._snap_at))  # fmt: skip
            stats = {
                "sync_s": time.perf_counter() - t_push,
                "push_wait_s": t0 - t_push,
                "snapshot_s": snap_s,
                "bytes": float(nbytes),
                "buckets": float(len(plan)),
                "attempts": float(attempt + 1),
                "wire_bytes": float(nbytes),
                "delta": float(self._delta_now),
            }
            return stats | self._stats

    async def _attempt(
        self,
        tensors: dict[str, torch.Tensor],
        version: int,
        snap: threading.Event,
        t_push: float,
        packed: list[tuple[BucketManifest, torch.Tensor]] | None,
        attempt: int,
    ) -> list[BucketManifest]:
        """One delivery of a push, the group formed first when it is not (a failed push broke
        it, or the engine set changed); the plan it delivered. ``_started`` tells whether
        anything of it reached an engine."""
        self._started = False
        if not self._formed:
            await self._reform_locked()
        plan = self._plan_for(tensors)
        if packed is None and not attempt:
            self._decide_delta()
        self._snap_at = t_push
        redo = self._packed if attempt and len(self._packed) == len(plan) else None
        self._started = True
        await self._deliver(plan, tensors, version, snap, redo or packed)
        return plan

    async def _deliver(
        self,
        plan: list[BucketManifest],
        tensors: dict[str, torch.Tensor],
        version: int,
        snap: threading.Event,
        packed: list[tuple[BucketManifest, torch.Tensor]] | None,
    ) -> None:
        """One attempt: [pause] begin, buckets, end, relabel [resume]. SGLang engines stay
        paused when it fails (their weights are undefined until a re-push lands)."""
        paused = self.pause_scope == "transfer"
        if paused:
            await self._all("/pause_generation", lambda c: c.pause_generation(self.pause_mode))
        ok = False
        try:
            try:
                await self._all("/begin_weight_update", lambda c: c.begin_weight_update())
            except WeightSyncError:  # e.g. a session a failed push left open: close, retry once
                await self._end_sessions()
                await self._all("/begin_weight_update", lambda c: c.begin_weight_update())
            try:
                acks = await self._stream(plan, tensors, version, snap, packed)
                await self._check_acks(acks)
            finally:
                await self._end_sessions()
            await self._commit(version)
            ok = True
        finally:
            if paused and (ok or not self.sglang):
                await self._resume_all()

    async def _end_sessions(self) -> None:
        results = await asyncio.gather(
            *(c.end_weight_update() for c in self.clients), return_exceptions=True
        )
        for c, r in zip(self.clients, results, strict=True):
            if isinstance(r, BaseException):
                log.warning("could not end the weight-update session on %s: %s", c.url, r)

    def _undefined(self, version: int, attempts: int, exc: BaseException) -> WeightsUndefined:
        urls = ", ".join(c.url for c in self.clients) or ", ".join(self.urls)
        return WeightsUndefined(
            f"weight push v{version} failed {attempts} time(s); the weights of SGLang "
            f"engine(s) {urls} are now UNDEFINED (SGLang loads each bucket into the live model "
            f"as it arrives, so a push that fails part-way leaves a mix of versions); they are "
            f"left paused. Last error: {exc}"
        )

    async def _reform_locked(self) -> None:
        await self._shutdown()
        # an answer may wait for every bucket; a push's own deadlines come first (named errors)
        wait_s = self._budget_s(self._upto[-1] if self._upto else 0) + self.cfg.timeout_s
        self.clients = [SGLangClient(u, timeout_s=wait_s) for u in self.urls]
        await asyncio.gather(*(c.wait_healthy(self.cfg.timeout_s) for c in self.clients))
        self._base_version = None  # an engine may have restarted or joined: next push is full
        if self._delta is not None:
            self._engines_delta = all(await asyncio.gather(*map(_takes_deltas, self.clients)))
        await self._form()
        self._formed = True

    async def _stream(
        self,
        plan: list[BucketManifest],
        tensors: dict[str, torch.Tensor],
        version: int,
        snap: threading.Event,
        prepacked: list[tuple[BucketManifest, torch.Tensor]] | None = None,
    ) -> Acks:
        loop = asyncio.get_running_loop()
        self._t_stream = loop.time()
        n, depth = len(plan), len(self._slot_bytes)
        self._in_place = set()
        self._packed = []
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
                            self._packer, self._pack_traced, k, tensors, version
                        )
                except (RuntimeError, ValueError, KeyError) as exc:
                    packed[k].set_exception(exc)
                    return
                packed[k].set_result(item)
                self._packed.append(item)
            for k in sorted(self._in_place):  # buckets sent from the tensors must have left
                await sent[k]
            self._snap_at = time.perf_counter()
            snap.set()  # every tensor read: the trainer may step its optimizer

        announced: list[asyncio.Future[Acks]] = [loop.create_future() for _ in plan]

        async def announce() -> None:  # control calls run ahead of the data, in bucket order
            for k in range(n):
                m, _ = await packed[k]
                announced[k].set_result(self._announce(m))

        producer = asyncio.ensure_future(produce())
        announcer = asyncio.ensure_future(announce())
        acks: Acks = []
        moving: list[asyncio.Future[None]] = []
        tracer = trace.get()
        kept = "weights undefined" if self.sglang else "kept old weights"

        def failed(k: int, exc: BaseException) -> WeightSyncError:
            self._formed = False  # the group may be out of step: re-form next time
            return WeightSyncError(f"v{version} bucket {k} ({kept}): {exc}")

        try:
            for k in range(n):
                m, flat = await packed[k]
                acks += await announced[k]
                bad = next((f for f in moving if f.done() and f.exception() is not None), None)
                if bad is not None:
                    break  # a bucket failed: stop posting (its error is raised below)
                lane, t_send = tracer.take_lane("weight send"), trace.now_us()
                try:
                    done = await self._transfer(m, flat, acks[-len(self.clients) :])
                except (EngineError, EngineUnavailable, RuntimeError, OSError) as exc:
                    tracer.free_lane(lane)
                    raise failed(k, exc) from exc
                done.add_done_callback(functools.partial(_resolve, sent[k]))
                done.add_done_callback(functools.partial(_traced_send, tracer, lane, k, t_send))
                moving.append(done)
            for k, done in enumerate(moving):  # in order: the first failure is reported
                try:
                    await done
                except (EngineError, EngineUnavailable, RuntimeError, OSError) as exc:
                    raise failed(k, exc) from exc
        finally:
            for f in sent:  # wake the producer; it stops at its next bucket
                if not f.done():
                    f.set_result(None)
            for task in (producer, announcer, *moving):
                if not task.done():
                    task.cancel()  # the pack in progress finishes in its thread first
            await asyncio.gather(producer, announcer, *moving, return_exceptions=True)
            pending = [t for f in announced if f.done() for _, t in f.result() if not t.done()]
            if pending and len(moving) < n:
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            await loop.run_in_executor(self._packer, lambda: None)  # packer idle: tensors released
        return acks

    async def _check_acks(self, acks: Acks) -> None:
        """Every engine's answer to every bucket, each within the push's budget (an engine
        that stopped reading is named with the first bucket it did not answer)."""
        loop = asyncio.get_running_loop()
        deadline, budget = self._deadline(len(self._upto) - 1)
        tasks = [t for _, t in acks]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
            if late:
                per = max(1, len(self.clients))
                first: dict[str, int] = {}
                for i, (u, t) in enumerate(acks):
                    if t in late:
                        first.setdefault(u, i // per)
                        t.cancel()
                await asyncio.gather(*late, return_exceptions=True)
                self._formed = False
                names = "; ".join(f"{u}: no answer to bucket {k}" for u, k in first.items())
                kept = "weights undefined" if self.sglang else "kept old weights"
                raise WeightSyncError(
                    f"{len(first)} engine(s) did not answer within {budget:.1f}s "
                    f"(weights.timeout_s per GiB; {kept}): {names}"
                )
        results = await asyncio.gather(*tasks, return_exceptions=True)  # all done by now
        per = max(1, len(self.clients))
        named = [
            (f"{u} (bucket {i // per})", r)
            for i, ((u, _), r) in enumerate(zip(acks, results, strict=True))
        ]
        self._raise_failed(named)

    def _raise_failed(self, results: list[tuple[str, Any]], prefix: str = "") -> None:
        """Raise WeightSyncError naming the engines whose result is an exception, if any;
        anything but an engine's own answer (unreachable, group error) breaks the group."""
        errors = [(u, r) for u, r in results if isinstance(r, BaseException)]
        if errors:
            if any(not isinstance(e, EngineError) for _, e in errors):
                self._formed = False
            detail = "; ".join(f"{u}: {e}" for u, e in errors[:4])
            kept = "weights undefined" if self.sglang else "kept old weights"
            raise WeightSyncError(
                f"{prefix}{len(errors)} engine(s) failed the update ({kept}): {detail}"
            )

    async def _commit(self, version: int) -> None:
        """Relabel every engine (the embedded engine: switch to the staged update)."""
        paused = self.pause_scope == "commit"
        if paused:
            await self._all("/pause_generation", lambda c: c.pause_generation(self.pause_mode))
        try:
            await self._all(
                "/update_weight_version", lambda c: c.update_weight_version(str(version))
            )
        finally:
            if paused:
                await self._resume_all()

    async def _all(self, what: str, call: Any) -> None:
        results = await asyncio.gather(
            *(_traced(what, c.url, call(c)) for c in self.clients), return_exceptions=True
        )
        errors = [
            (c.url, r)
            for c, r in zip(self.clients, results, strict=True)
            if isinstance(r, BaseException)
        ]
        if errors:
            if any(not isinstance(e, EngineError) for _, e in errors):
                self._formed = False  # an engine unreachable (died?): re-form next time
            detail = "; ".join(f"{u}: {e}" for u, e in errors)
            raise WeightSyncError(f"{what} failed on {len(errors)} engine(s): {detail}")

    async def _resume_all(self) -> None:
        results = await asyncio.gather(
            *(
                _traced("/continue_generation", c.url, c.continue_generation())
                for c in self.clients
            ),
            return_exceptions=True,
        )
        for c, r in zip(self.clients, results, strict=True):
            if isinstance(r, BaseException):
                log.warning("could not resume %s: %s", c.url, r)


async def _traced(what: str, url: str, call: Coroutine[Any, Any, Any]) -> Any:
    """``call`` to the engine at ``url`` as a span of that engine's track."""
    with trace.get().span(what, f"engine {url}"):
        return await call


def _resolve(fut: asyncio.Future[None], _: object) -> None:
    """Done-callback: complete ``fut`` unless it already is."""
    if not fut.done():
        fut.set_result(None)


def _traced_send(tracer: trace.Tracer, lane: str, k: int, t0: float, _: object = None) -> None:
    tracer.complete(f"send bucket {k}", lane, t0, trace.now_us())
    tracer.free_lane(lane)


async def _takes_deltas(client: SGLangClient) -> bool:
    """Whether the engine says (``/get_server_info``) that it applies delta buckets."""
    try:
        info = await client.get_server_info()
    except (EngineError, EngineUnavailable):
        return False
    return bool(info.get(DELTA_CAPABILITY))
