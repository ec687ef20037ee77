"""Collective weight transport (NCCL / HCCL / Gloo) into SGLang-protocol engines.

The weight group is a process group of its own — trainer rank 0 is rank 0,
engine i is rank ``1 + i`` (SGLang's ``rank_offset``) — built from a TCPStore,
so the trainer's default group (and its world) is never touched. Each bucket
is one broadcast of a flat buffer, announced to every engine by
``/update_weights_from_distributed`` with ``load_format="flattened_bucket"``
plus an ``asyncrl_bucket`` field (index, count, version, checksum, chunks)
that SGLang ignores. The commit is ``/update_weight_version`` (see ``sender``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import importlib.util
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.engines.rollout.base import EngineError
from asyncrl.net import gloo_options, tcp_store
from asyncrl.procs import free_port
from asyncrl.transports.weights.bucket import BucketManifest
from asyncrl.transports.weights.sender import Acks, BucketSender, bucket_extra

__all__ = [
    "CollectiveWeightSender",
    "broadcast",
    "destroy_weight_group",
    "finish_broadcast",
    "new_weight_group",
    "post_broadcast",
    "resolve_backend",
]

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


def new_weight_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 300.0,
    bind_address: str = "",
) -> dist.ProcessGroup:
    """Join the dedicated weight-sync group (blocks until every rank joined).

    Formed exactly as SGLang's receiving ranks form it (``init_custom_process_group``,
    sglang 0.5.23 ``srt/utils/common.py:2859-2927``, the same since 0.5.10
    ``common.py:1698``): a ``tcp://`` rendezvous (rank 0 hosts the store), wrapped in
    ``PrefixStore(group_name)``, then torch's ``_new_process_group_helper`` with
    ``group_name``, which adds its own key prefixes. A group built any other way waits on
    other store keys: Gloo times out, NCCL hangs on the first broadcast. The group is
    registered under ``group_name`` in this process: :func:`destroy_weight_group` releases
    the name (a group of the same name cannot be formed again before). The trainer's
    default group is never touched.

    ``bind_address``: the address this rank advertises to its peers (Gloo binds there,
    unless ``GLOO_SOCKET_IFNAME`` says otherwise); empty: Gloo's default (the hostname's).
    Only the Gloo device changes (see :func:`_gloo_bound`; SGLang's ranks bind per
    ``GLOO_SOCKET_IFNAME``); the store keys stay the same.
    """
    from torch.distributed import distributed_c10d as c10d

    if backend not in ("gloo", "nccl", "hccl"):
        raise ValueError(f"unknown weight-sync backend {backend!r} (allowed: gloo, nccl, hccl)")
    if backend == "hccl":
        import torch_npu  # noqa: F401  (registers the hccl backend with torch.distributed)
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:  # the store's server listens on master_address only (rendezvous': on all)
        store = tcp_store(master_address, master_port, world_size, True, timeout_s)
    else:
        url = f"tcp://{_host(master_address)}:{int(master_port)}"
        store, rank, world_size = next(c10d.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    stale = [pg for pg, name in c10d._world.pg_names.items() if name == group_name]
    for pg in stale:  # a group of ours left behind by a failed form or push
        destroy_weight_group(pg)
    with _gloo_bound(c10d, bind_address if backend == "gloo" else "", timeout_s):
        pg, _ = c10d._new_process_group_helper(
            world_size,
            rank,
            [],
            c10d.Backend(backend),
            store,
            group_name=group_name,
            timeout=timeout,
        )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


_BIND = threading.local()  # .address: where Gloo backends made by this thread bind


@contextlib.contextmanager
def _gloo_bound(c10d: Any, address: str, timeout_s: float) -> Iterator[None]:
    """Gloo backends this thread makes inside bind their device to ``address`` exactly.

    torch's ``_new_process_group_helper`` builds each Gloo backend as
    ``ProcessGroupGloo(store, rank, size, timeout=...)`` and ignores backend options
    (torch 2.13 ``distributed_c10d.py:2163-2175``: "GLOO options not supported"), so the
    device comes from the hostname or ``GLOO_SOCKET_IFNAME``; an interface name cannot
    tell loopback aliases apart, and a hostname mapped to 127.0.1.1 advertises loopback
    to other hosts. So the class the helper calls becomes (once per process) a subclass
    that passes explicit options when the calling thread asked for an address, and is
    the plain constructor otherwise (same store keys either way; a subclass because the
    helper checks ``isinstance(.., ProcessGroupGloo)``; per thread because constructing
    blocks until every rank joined, and ranks of one group may share a process).
    """
    if not address:
        yield
        return
    if not getattr(c10d.ProcessGroupGloo, "_asyncrl_bound", False):
        real = c10d.ProcessGroupGloo

        class Bound(real):
            _asyncrl_bound = True

            def __init__(self, store: Any, rank: int, size: int, timeout: Any = None) -> None:
                addr, secs = getattr(_BIND, "target", ("", 0.0))
                if addr:
                    super().__init__(store, rank, size, gloo_options(addr, secs))
                elif timeout is None:
                    super().__init__(store, rank, size)
                else:
                    super().__init__(store, rank, size, timeout)

        c10d.ProcessGroupGloo = Bound
    _BIND.target = (address, timeout_s)
    try:
        yield
    finally:
        _BIND.target = ("", 0.0)


def destroy_weight_group(group: dist.ProcessGroup | None) -> None:
    """Leave a group made by :func:`new_weight_group` and release its name (best effort)."""
    if group is None:
        return
    try:
        dist.destroy_process_group(group)
    except (RuntimeError, ValueError, KeyError) as exc:
        log.warning("destroying the weight group: %s", exc)


def _host(address: str) -> str:
    """An address as a ``tcp://`` URL's host (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def post_broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> dist.Work:
    """Start one broadcast on ``group`` and return at once (see :func:`finish_broadcast`).

    Every rank must post the group's broadcasts in the same order. Posting the next
    one before the last finished keeps the link busy across buckets: the backend
    moves them back to back, with no round trip or thread wake-up in between.
    """
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    return group.broadcast([tensor], opts)


def finish_broadcast(work: dist.Work, tensor: torch.Tensor) -> None:
    """Block until a posted broadcast is done and ``tensor`` may be reused (device synced)."""
    work.wait()
    if tensor.device.type == "cuda":
        torch.cuda.current_stream(tensor.device).synchronize()


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    """One broadcast on ``group``; returns once ``tensor`` may be reused (device synced)."""
    finish_broadcast(post_broadcast(group, tensor, src), tensor)


def _refused(task: asyncio.Task[Any]) -> bool:
    """The engine did not take part in the bucket's broadcast (HTTP error, unreachable)."""
    if task.cancelled() or task.exception() is None:
        return False
    exc = task.exception()
    return not (isinstance(exc, EngineError) and exc.status == 200)  # 200: received, then failed


class CollectiveWeightSender(BucketSender):
    """WeightTransport over a collective group (see module docstring)."""

    zero_copy_ok = True  # a broadcast has read its buffer when it returns
    early_announce = True  # engines queue announced buckets and receive them in order

    def __init__(
        self,
        engine_urls: Any,
        cfg: Any,
        backend: str,
        pause_mode: str = "abort",
        device: str = "cpu",
    ):
        super().__init__(engine_urls, cfg, device=device, pause_mode=pause_mode)
        self.backend = backend
        self._group: dist.ProcessGroup | None = None
        self._bcast = ThreadPoolExecutor(1, thread_name_prefix="weight-bcast")  # waits, in order
        # posts, in order, off the event loop: NCCL/HCCL set up their communicator on the
        # group's first collective, which blocks until every rank joins it
        self._poster = ThreadPoolExecutor(1, thread_name_prefix="weight-post")

    async def _form(self) -> None:
        port = free_port(self.cfg.master_address)
        world = 1 + len(self.clients)
        calls = [
            c.init_weights_update_group(
                master_address=self.cfg.master_address,
                master_port=port,
                rank_offset=1 + i,
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
        return [
            (
                c.url,
                asyncio.ensure_future(
                    c.update_weights_from_distributed(
                        names=names,
                        dtypes=[m.dtype] * len(names),
                        shapes=[e.wire_shape for e in m.entries],
                        group_name=self.cfg.group_name,
                        flush_cache=m.index == m.count - 1,
                        load_format="flattened_bucket",
                        extra=extra,
                    )
                ),
            )
            for c in self.clients
        ]

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
        return asyncio.ensure_future(self._watch(m, sent, acks))

    async def _watch(self, m: BucketManifest, sent: asyncio.Future[None], acks: Acks) -> None:
        while not sent.done():
            await asyncio.wait([sent, *(t for _, t in acks)], return_when=asyncio.FIRST_COMPLETED)
            refused = [(u, t) for u, t in acks if t.done() and _refused(t)]
            if refused and not sent.done():
                url, task = refused[0]
                raise RuntimeError(f"{url} refused bucket {m.index}: {task.exception()}")
            if all(t.done() for _, t in acks):
                break
        await sent

    async def _send_bucket(self, m: BucketManifest, flat: torch.Tensor) -> Acks:
        acks = self._announce(m)
        try:
            await (await self._transfer(m, flat, acks))
        except RuntimeError:
            for _, t in acks:
                t.cancel()
            await asyncio.gather(*(t for _, t in acks), return_exceptions=True)
            raise
        return acks
