"""Collective weight transport (NCCL / HCCL / Gloo), trainer side: the sender.

Runs in the trainer process (rank 0). The weight group is a process group of its own
(see ``collective_wire``) — trainer rank 0 is rank 0, engine i's ranks follow from
``rank_offset = 1 + ranks of the engines before`` — built from a TCPStore, so the
trainer's default group (and its world) is never touched. Each bucket is one broadcast of
a flat buffer, announced to every engine in its family's load format (the
:class:`~asyncrl.transports.weights.seam.WeightAdapter` the caller hands in: SGLang's
``flattened_bucket`` plus the ``asyncrl_bucket`` field the embedded engine reads, vLLM's
``/update_weights``...). The embedded engine's side is
``engines/rollout/local/collective_recv.py``.

A push (see ``base`` for the contract): ``push`` only takes references to the tensors;
the engine group's loop (``send_engines``) then delivers it, one push at a time, in
order: [pause] begin sessions, the buckets (``send_stream``: packed by ``send_staging``,
announced, broadcast, acked), end sessions, commit (``/update_weight_version``, engines
paused only around it when ``pause_scope="commit"``) [resume]. Any failure skips the
commit: the engines drop what they staged and keep their weights and version; the
push's handle raises :class:`WeightSyncError`.

Families that load every bucket into the live model as it arrives (``loads_live``: no
staging, no chunk of a tensor) get whole tensors only, generation paused for the whole
transfer, the engines' update session around the buckets, their version with the last
bucket or the session's close (the family's announcement says which), and relabelling
before generation resumes. A failed push leaves their weights undefined: it is re-pushed
from the staged copy as a whole new round (``weights.repush_attempts`` times, engines
still paused), and when that fails too the push raises, saying so, and the engines stay
paused. See docs/weight-sync.md, "Per backend", and docs/rollout-engines.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import logging
import threading
import time
from collections.abc import Coroutine, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from asyncrl import trace
from asyncrl.config import CollectiveWeightsConfig
from asyncrl.procs import free_port
from asyncrl.transports.weights.base import (
    PushHandle,
    WeightSyncError,
)
from asyncrl.transports.weights.bucket import BucketManifest
from asyncrl.transports.weights.collective_wire import TorchLink, new_weight_group
from asyncrl.transports.weights.delta import DELTA_CAPABILITY
from asyncrl.transports.weights.seam import (
    EngineControl,
    EngineError,
    EngineUnavailable,
    GroupSpec,
    TrainerLink,
    WeightAdapter,
)
from asyncrl.transports.weights.send_engines import EngineGroup, GroupSender, settle
from asyncrl.transports.weights.send_staging import BucketStager
from asyncrl.transports.weights.send_stream import Acks, BucketStream, Push

__all__ = ["CollectiveWeightSender", "resolve_backend"]

log = logging.getLogger("asyncrl.weights")

_INSTALL = {
    "nccl": "a CUDA device and a CUDA build of torch (pip install torch --index-url "
    "https://download.pytorch.org/whl/cu128)",
    "hccl": "an Ascend NPU and torch_npu (pip install torch-npu, matching your torch version)",
}


def resolve_backend(name: str, device: str) -> str:
    """The collective backend to use, checked once against what this machine has."""
    if name == "auto":
        if device.startswith("cuda"):
            name = "nccl"
        elif device.startswith("npu"):
            name = "hccl"
        else:
            return "gloo"
    if name == "gloo":
        if not dist.is_gloo_available():
            raise ValueError("weights.backend='gloo' needs a torch built with Gloo")
        return name
    if name == "nccl":
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ValueError(f"weights.backend='nccl' needs {_INSTALL['nccl']}; or use 'gloo'")
        return name
    if name == "hccl":
        if importlib.util.find_spec("torch_npu") is None:
            raise ValueError(f"weights.backend='hccl' needs {_INSTALL['hccl']}; or use 'gloo'")
        return name
    raise ValueError(
        f"weights.backend={name!r} is not a collective backend (allowed: gloo, nccl, hccl)"
    )


def _refused(task: asyncio.Task[Any], family: WeightAdapter) -> bool:
    """The engine did not take part in the bucket's broadcast (HTTP error, unreachable).

    The family says (``WeightAdapter.received``): which error answers still mean the engine
    took part in the broadcast."""
    if task.cancelled() or task.exception() is None:
        return False
    exc = task.exception()
    if not isinstance(exc, EngineError):
        return True
    return not (exc.status == 200 or family.received(exc))


def _close(coro: Coroutine[Any, Any, Any], _: object) -> None:
    """Done-callback: close ``coro`` (a no-op once it ran; one never started is dropped)."""
    coro.close()


def _seen(fut: asyncio.Future[Any]) -> None:
    """Mark a future's exception as retrieved (asyncio would log it as never retrieved)."""
    if not fut.cancelled():
        fut.exception()


async def _after(prev: asyncio.Future[Any] | None, call: Coroutine[Any, Any, Any], k: int) -> Any:
    """Send ``call`` once the engine answered the previous bucket's; not at all when that
    one failed (the engine would receive this bucket's broadcast in the wrong turn)."""
    if prev is not None:
        try:
            await asyncio.shield(prev)
        except (EngineError, EngineUnavailable, asyncio.CancelledError) as exc:
            call.close()
            raise RuntimeError(f"bucket {k} not sent: bucket {k - 1} failed ({exc})") from exc
    return await call


class CollectiveWeightSender(GroupSender):
    """WeightTransport over a collective group (see module docstring): the engine group
    (``engines``), the stager and the stream are its parts; it is the group's
    :class:`~asyncrl.transports.weights.send_engines.Formation` and the stream's
    :class:`~asyncrl.transports.weights.send_stream.BucketLink`."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        cfg: CollectiveWeightsConfig,
        backend: str,
        family: WeightAdapter,
        pause_mode: str = "abort",
        device: str = "cpu",
    ):
        self.cfg = cfg
        self.backend = backend
        self.device = device
        self.engines = EngineGroup(engine_urls, cfg, self, family, pause_mode=pause_mode)
        live = self.engines.loads_live
        # a broadcast has read its buffer when it returns; a delta is one broadcast too
        self.stager = BucketStager(
            cfg, torch.device(device), whole=live, zero_copy_ok=True, delta_ok=True
        )
        self.stream = BucketStream(self.engines, self.stager, self)
        self._last: PushHandle | None = None
        self._flush = True  # the family's flush rule for the last bucket (see form)
        self._chain: dict[str, asyncio.Future[Any]] = {}  # live loaders: each engine's last call
        self._link: TrainerLink | None = None  # rank 0's end of the formed group
        self._bcast = ThreadPoolExecutor(1, thread_name_prefix="weight-bcast")  # waits, in order
        # posts, in order, off the event loop: NCCL/HCCL set up their communicator on the
        # group's first collective, which blocks until every rank joins it
        self._poster = ThreadPoolExecutor(1, thread_name_prefix="weight-post")

    # -- WeightTransport (connect, engines_changed: GroupSender) ----------------------------
    def close(self) -> None:
        """Wait for the push in flight, tear the group down, stop the sender's threads."""
        settle(self._last, self.cfg.timeout_s)
        self.engines.close()
        self.stream.close()

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
            plan = self.stager.plan_for(tensors)
            self.stager.decide_delta()
            packed = [self.stager.pack(k, tensors, version) for k in range(len(plan))]
            snap.set()
        fut = self.engines.run(self._push(Push(tensors, version, snap, t0, packed)))
        self._last = PushHandle(version, fut, snap)
        return self._last

    # -- a push, on the group's loop -----------------------------------------------------
    async def _push(self, push: Push) -> dict[str, float]:
        """Deliver one push (re-pushed to engines that load live, on failure); its stats."""
        assert self.engines.lock is not None, "connect() first"
        async with self.engines.lock:
            t0 = time.perf_counter()
            pauses = self.engines.pauses
            try:
                plan, attempts = await self.stream.deliver(push)
            except BaseException:
                self.stager.forget_base()  # engines may hold anything staged: next push is full
                raise
            finally:
                push.snap.set()
            version = push.version
            self.stager.pushed(version)
            stats = self._stats(plan, version, push.t_push, t0, attempts)
            stats["pauses"] = float(self.engines.pauses - pauses)  # 0 with pause_scope none
            digest = self.stream.digest
            if digest is not None and digest.engines(version, self.engines.clients):
                # weights.verify on engines that report digests: tensors compared / held
                stats["push_verify_compared"] = float(digest.compared)
                stats["push_verify_total"] = float(digest.total)
            return stats

    def _stats(
        self, plan: list[BucketManifest], version: int, t_push: float, t0: float, attempts: int
    ) -> dict[str, float]:
        """A delivered push's trace spans and stats (seconds, bytes, counts)."""
        snap_at = self.stream.snap_at
        nbytes = sum(m.nbytes for m in plan)
        tracer = trace.get()
        t_end = trace.now_us()
        tracer.complete(f"push v{version}", "weight sync", trace.us_of(t0), t_end,
                        {"bytes": nbytes, "buckets": len(plan)})  # fmt: skip
        tracer.complete(f"snapshot v{version}", "weight snapshot", trace.us_of(t_push),
                        trace.us_of(snap_at))  # fmt: skip
        stats = {
            "sync_s": time.perf_counter() - t_push,
            "push_wait_s": t0 - t_push,
            "snapshot_s": snap_at - t_push,
            "bytes": float(nbytes),
            "buckets": float(len(plan)),
            "attempts": float(attempts),
            "wire_bytes": float(nbytes),
            "delta": float(self.stager.delta_now),
        }
        return stats | self.stager.stats

    # -- Formation: the group's (re)forming ----------------------------------------------
    def client_timeout_s(self) -> float:
        """An answer may wait for every bucket; a push's own deadlines come first (named
        errors)."""
        upto = self.stager.upto
        return self.stager.budget_s(upto[-1] if upto else 0) + self.cfg.timeout_s

    async def form(self) -> None:
        """Rank 0 is ours; engine i's ranks are ``offset_i + rank`` with ``offset_i = 1 +
        sum(tp_j, j < i)`` (SGLang joins ``rank_offset + tp_rank``, 0.5.23
        model_runner_components/weight_updater.py:124; vLLM ``rank_offset + dp·TP·PP +
        rank``, nccl_common.py:239-244, its ``tp_size`` being all its ranks); world = 1 +
        sum(tp). The engines' calls and our own join run concurrently (the store's host,
        rank 0, waits for every rank)."""
        clients = self.engines.clients
        self.stager.forget_base()  # an engine may have restarted or joined: next push is full
        if self.stager.delta is not None:
            self.stager.engines_delta = all(await asyncio.gather(*map(_takes_deltas, clients)))
        infos = await asyncio.gather(*(c.get_server_info() for c in clients))
        tps = [max(1, int(info.get("tp_size", 1))) for info in infos]
        self._flush = self.engines.family.check(infos, self.engines.pause_mode)
        port = free_port(self.cfg.master_address)
        world = 1 + sum(tps)
        offsets = [1 + sum(tps[:i]) for i in range(len(tps))]
        calls = [
            c.init_weights_update_group(
                GroupSpec(
                    master_address=self.cfg.master_address,
                    master_port=port,
                    rank_offset=offsets[i],
                    world_size=world,
                    group_name=self.cfg.group_name,
                    backend=self.backend,
                )
            )
            for i, c in enumerate(clients)
        ]
        own = asyncio.to_thread(self._join, port, world)
        results = await asyncio.gather(own, *calls)
        self._link = results[0]

    def _join(self, port: int, world: int) -> TrainerLink:
        """Rank 0's join (in a thread): the family's own NCCL group where it has one (vLLM's
        ``PyNcclCommunicator``, ``vllm/trainer_nccl.py``), else torch's group."""
        own = self.engines.family.trainer_link(
            self.backend, self.cfg.master_address, port, world, self.device
        )
        if own is not None:
            return own
        group = new_weight_group(
            self.backend,
            self.cfg.master_address,
            port,
            0,
            world,
            self.cfg.group_name,
            self.cfg.timeout_s,
            self.cfg.master_address,
        )
        return TorchLink(group)

    async def teardown(self) -> None:
        """Leave the group (a stuck destroy is retried when re-formed); engines leave it."""
        link, self._link = self._link, None
        if link is not None:  # release the group's name (a stuck one is retried when re-formed)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.to_thread(link.close), 10.0)
        for pool in (self._bcast, self._poster):
            pool.shutdown(wait=False)  # a broadcast stuck on a dead peer times out alone
        self._bcast = ThreadPoolExecutor(1, thread_name_prefix="weight-bcast")
        self._poster = ThreadPoolExecutor(1, thread_name_prefix="weight-post")
        await asyncio.gather(
            *(c.destroy_weights_update_group(self.cfg.group_name) for c in self.engines.clients),
            return_exceptions=True,
        )

    # -- BucketLink: one bucket ----------------------------------------------------------
    def announce(self, m: BucketManifest) -> Acks:
        """Start the bucket's control call to every engine (it may run ahead of the data)."""
        live = self.engines.loads_live
        family = self.engines.family
        if m.index == 0:
            self._chain = {}
        acks: Acks = []
        for c in self.engines.clients:
            # in the family's load format (its flush rule, its version on the last bucket)
            call = family.announce(c, m, self.cfg.group_name, self._flush)
            inner = call
            if live:  # engines that load live serve update calls in arrival order: one at a time
                call = _after(self._chain.get(c.url), call, m.index)
            task = asyncio.ensure_future(call)
            task.add_done_callback(_seen)  # read by check_acks; a failed push may not get there
            # a call cancelled before _after ran never started: close it (no "never awaited")
            task.add_done_callback(functools.partial(_close, inner))
            self._chain[c.url] = task
            acks.append((c.url, task))
        return acks

    async def transfer(
        self, m: BucketManifest, flat: torch.Tensor, acks: Acks, deadline: tuple[float, float]
    ) -> asyncio.Future[None]:
        """Post the bucket's broadcast; the result completes once ``flat`` may be reused.

        It fails fast when an engine refused the bucket (it will never receive it).
        """
        link = self._link
        assert link is not None, "connect() first"
        loop = asyncio.get_running_loop()
        wire = flat.view(torch.uint8)  # bytes: the tensors back to back
        work = await loop.run_in_executor(self._poster, link.post, wire)
        sent = loop.run_in_executor(self._bcast, link.finish, work, flat)
        sent.add_done_callback(_seen)  # its error, when _watch raised first, is that one's
        return asyncio.ensure_future(self._watch(m, sent, acks, deadline))

    async def _watch(
        self,
        m: BucketManifest,
        sent: asyncio.Future[None],
        acks: Acks,
        deadline: tuple[float, float],
    ) -> None:
        loop = asyncio.get_running_loop()
        until, budget = deadline
        while not sent.done():
            left = until - loop.time()
            if left <= 0:  # an engine stopped reading (hung, stopped, unreachable)
                waiting = [u for u, t in acks if not t.done()] or ["none"]
                raise RuntimeError(
                    f"broadcast not done within {budget:.1f}s (weights.timeout_s per GiB so far); "
                    f"engines not done with bucket {m.index}: {', '.join(waiting)}"
                )
            await asyncio.wait(
                [sent, *(t for _, t in acks)], timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            refused = [(u, t) for u, t in acks if t.done() and _refused(t, self.engines.family)]
            if refused and not sent.done():
                url, task = refused[0]
                raise RuntimeError(f"{url} refused bucket {m.index}: {task.exception()}")
            if all(t.done() for _, t in acks):
                break
        await sent


async def _takes_deltas(client: EngineControl) -> bool:
    """Whether the engine says (``/get_server_info``) that it applies delta buckets."""
    try:
        info = await client.get_server_info()
    except (EngineError, EngineUnavailable):
        return False
    return bool(info.get(DELTA_CAPABILITY))
