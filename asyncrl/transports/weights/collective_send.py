"""Collective weight transport (NCCL / HCCL / Gloo), trainer side: the sender.

Runs in the trainer process (rank 0). The weight group is a process group of its own
(see ``collective_wire``) — trainer rank 0 is rank 0, engine i is rank ``1 + i``
(SGLang's ``rank_offset``) — built from a TCPStore, so the trainer's default group (and
its world) is never touched. Each bucket is one broadcast of a flat buffer, announced to
every engine by ``/update_weights_from_distributed`` with
``load_format="flattened_bucket"`` plus an ``asyncrl_bucket`` field (index, count,
version, checksum, chunks) that SGLang ignores. The commit is ``/update_weight_version``
(see ``sender``). The engine's side is ``collective_recv``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.engines.rollout.base import EngineError, EngineUnavailable
from asyncrl.procs import free_port
from asyncrl.transports.weights.bucket import BucketManifest
from asyncrl.transports.weights.collective_wire import (
    bucket_extra,
    destroy_weight_group,
    finish_broadcast,
    new_weight_group,
    post_broadcast,
)
from asyncrl.transports.weights.sender import Acks, BucketSender

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


def _refused(task: asyncio.Task[Any], sglang: bool) -> bool:
    """The engine did not take part in the bucket's broadcast (HTTP error, unreachable).

    The embedded engine answers ``success: false`` with HTTP 200 once it received, 4xx only
    before. SGLang answers 400 with its JSON body also after receiving and loading
    (0.5.23 http_server.py:1488-1505): its handler ran, so the broadcast is waited for.
    """
    if task.cancelled() or task.exception() is None:
        return False
    exc = task.exception()
    if not isinstance(exc, EngineError):
        return True
    return not (exc.status == 200 or (sglang and exc.answered))


def _seen(fut: asyncio.Future[Any]) -> None:
    """Mark a future's exception as retrieved (asyncio would log it as never retrieved)."""
    if not fut.cancelled():
        fut.exception()


def sglang_release(info: dict[str, Any]) -> tuple[int, ...]:
    """The SGLang version in a ``/server_info`` answer (``version``); the embedded engine,
    which has none, counts as the newest."""
    text = str(info.get("version", ""))
    parts = [int(p) for p in text.split(".")[:3] if p.isdigit()]
    return tuple(parts) if len(parts) >= 2 else (99,)


async def _after(prev: asyncio.Future[Any] | None, call: Coroutine[Any, Any, Any], k: int) -> Any:
    """Send ``call`` once the engine answered the previous bucket's; not at all when that
    one failed (SGLang would receive this bucket's broadcast in the wrong turn)."""
    if prev is not None:
        try:
            await asyncio.shield(prev)
        except (EngineError, EngineUnavailable, asyncio.CancelledError) as exc:
            call.close()
            raise RuntimeError(f"bucket {k} not sent: bucket {k - 1} failed ({exc})") from exc
    return await call


class CollectiveWeightSender(BucketSender):
    """WeightTransport over a collective group (see module docstring)."""

    zero_copy_ok = True  # a broadcast has read its buffer when it returns
    delta_ok = True  # a delta bucket is one broadcast of its payload
    early_announce = True  # engines queue announced buckets and receive them in order

    def __init__(
        self,
        engine_urls: Any,
        cfg: Any,
        backend: str,
        pause_mode: str = "abort",
        device: str = "cpu",
        engine: str = "local",
    ):
        super().__init__(engine_urls, cfg, device=device, pause_mode=pause_mode, engine=engine)
        self.backend = backend
        self._flush = True  # flush SGLang's prefix cache with the last bucket (see _form)
        self._chain: dict[str, asyncio.Future[Any]] = {}  # SGLang: each engine's last call
        self._group: dist.ProcessGroup | None = None
        self._bcast = ThreadPoolExecutor(1, thread_name_prefix="weight-bcast")  # waits, in order
        # posts, in order, off the event loop: NCCL/HCCL set up their communicator on the
        # group's first collective, which blocks until every rank joins it
        self._poster = ThreadPoolExecutor(1, thread_name_prefix="weight-post")

    async def _form(self) -> None:
        """Rank 0 is ours; engine i's TP ranks are ``offset_i + tp_rank`` with ``offset_i = 1 +
        sum(tp_j, j < i)`` (SGLang joins ``rank_offset + tp_rank``, 0.5.23
        model_runner_components/weight_updater.py:124); world = 1 + sum(tp)."""
        infos = await asyncio.gather(*(c.get_server_info() for c in self.clients))
        tps = [max(1, int(info.get("tp_size", 1))) for info in infos]
        self._check_sglang(infos)
        port = free_port(self.cfg.master_address)
        world = 1 + sum(tps)
        offsets = [1 + sum(tps[:i]) for i in range(len(tps))]
        calls = [
            c.init_weights_update_group(
                master_address=self.cfg.master_address,
                master_port=port,
                rank_offset=offsets[i],
                world_size=world,
                group_name=self.cfg.group_name,
                backend=self.backend,
            )
            for i, c in enumerate(self.clients)
        ]
        own = asyncio.to_thread(
            new_weight_group,
            self.backend,
            self.cfg.master_address,
            port,
            0,
            world,
            self.cfg.group_name,
            self.cfg.timeout_s,
            self.cfg.master_address,
        )
        results = await asyncio.gather(own, *calls)
        self._group = results[0]

    def _check_sglang(self, infos: list[dict[str, Any]]) -> None:
        """Refuse what an engine's SGLang version cannot do exactly; choose ``flush_cache``.

        SGLang < 0.5.22 reports one version per request (no spans): only ``abort`` keeps
        every token's version exact. ``flush_cache`` fails unless the engine is idle: with
        ``in_place`` always (0.5.22+: 400 "weights updated, cache not flushed",
        scheduler_components/weight_updater.py:120-133; 0.5.10: an assertion kills the
        scheduler, scheduler_update_weights_mixin.py:80-82), with ``retract`` before 0.5.22
        (retracted requests wait in the queue, scheduler.py:2900-2918 in 0.5.10).
        """
        if not self.sglang:
            return
        oldest = min(sglang_release(i) for i in infos)
        if oldest < (0, 5, 22) and self.pause_mode != "abort":
            raise ValueError(
                f"rollout.pause_mode={self.pause_mode!r} needs SGLang >= 0.5.22 (per-token "
                f"version spans); an engine runs {'.'.join(map(str, oldest))}: use 'abort'"
            )
        self._flush = self.pause_mode == "abort" or (
            self.pause_mode == "retract" and oldest >= (0, 5, 22)
        )

    async def _teardown(self) -> None:
        group, self._group = self._group, None
        if group is not None:  # release the group's name (a stuck one is retried when re-formed)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.to_thread(destroy_weight_group, group), 10.0)
        for pool in (self._bcast, self._poster):
            pool.shutdown(wait=False)  # a broadcast stuck on a dead peer times out alone
        self._bcast = ThreadPoolExecutor(1, thread_name_prefix="weight-bcast")
        self._poster = ThreadPoolExecutor(1, thread_name_prefix="weight-post")
        await asyncio.gather(
            *(c.destroy_weights_update_group(self.cfg.group_name) for c in self.clients),
            return_exceptions=True,
        )

    def _announce(self, m: BucketManifest) -> Acks:
        """Start the bucket's control call to every engine (it may run ahead of the data)."""
        names = [e.name for e in m.entries]
        extra = {"asyncrl_bucket": bucket_extra(m)}
        last = m.index == m.count - 1
        if m.index == 0:
            self._chain = {}
        acks: Acks = []
        for c in self.clients:
            call = c.update_weights_from_distributed(
                names=names,
                dtypes=[m.dtype] * len(names),
                shapes=[e.wire_shape for e in m.entries],
                group_name=self.cfg.group_name,
                flush_cache=last and self._flush,
                # SGLang relabels with the last bucket's load
                # (scheduler_components/weight_updater.py:224)
                weight_version=str(m.version) if last and self.sglang else None,
                load_format="flattened_bucket",
                extra=extra,
            )
            if self.sglang:  # SGLang serves update calls in arrival order: one at a time
                call = _after(self._chain.get(c.url), call, m.index)
            task = asyncio.ensure_future(call)
            task.add_done_callback(_seen)  # read by _check_acks; a failed push may not get there
            self._chain[c.url] = task
            acks.append((c.url, task))
        return acks

    async def _transfer(
        self, m: BucketManifest, flat: torch.Tensor, acks: Acks
    ) -> asyncio.Future[None]:
        """Post the bucket's broadcast; the result completes once ``flat`` may be reused.

        It fails fast when an engine refused the bucket (it will never receive it).
        """
        assert self._group is not None, "connect() first"
        loop = asyncio.get_running_loop()
        wire = flat.view(torch.uint8)  # bytes: what SGLang receives into (FlattenedTensorBucket)
        work = await loop.run_in_executor(self._poster, post_broadcast, self._group, wire)
        sent = loop.run_in_executor(self._bcast, finish_broadcast, work, flat)
        sent.add_done_callback(_seen)  # its error, when _watch raised first, is that one's
        return asyncio.ensure_future(self._watch(m, sent, acks))

    async def _watch(self, m: BucketManifest, sent: asyncio.Future[None], acks: Acks) -> None:
        loop = asyncio.get_running_loop()
        deadline, budget = self._deadline(m.index)
        while not sent.done():
            left = deadline - loop.time()
            if left <= 0:  # an engine stopped reading (hung, stopped, unreachable)
                waiting = [u for u, t in acks if not t.done()] or ["none"]
                raise RuntimeError(
                    f"broadcast not done within {budget:.1f}s (weights.timeout_s per GiB so far); "
                    f"engines not done with bucket {m.index}: {', '.join(waiting)}"
                )
            await asyncio.wait(
                [sent, *(t for _, t in acks)], timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            refused = [(u, t) for u, t in acks if t.done() and _refused(t, self.sglang)]
            if refused and not sent.done():
                url, task = refused[0]
                raise RuntimeError(f"{url} refused bucket {m.index}: {task.exception()}")
            if all(t.done() for _, t in acks):
                break
        await sent
