"""Collective weight transport (NCCL / HCCL / Gloo) into SGLang-protocol engines.

The weight group is a process group of its own — trainer rank 0 is rank 0,
engine i is rank ``1 + i`` — built from a TCPStore, so the trainer's default
group (and its world) is never touched. Each bucket is one broadcast of a flat
buffer, announced to every engine by ``/update_weights_from_distributed`` with
``load_format="flattened_bucket"``; the last bucket carries ``weight_version``
and ``flush_cache=True`` (the engine's commit point).
"""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from asyncrl.config import WeightSyncConfig
from asyncrl.engines.rollout.sglang import SGLangClient
from asyncrl.procs import free_port
from asyncrl.transports.weights.base import PushHandle, WeightSyncError
from asyncrl.transports.weights.bucket import (
    BucketManifest,
    pack_into,
    plan_buckets,
    spec_of,
    unpack,
)

__all__ = [
    "CollectiveWeightSender",
    "broadcast",
    "new_weight_group",
    "receive_flattened_bucket",
    "resolve_backend",
]


def resolve_backend(name: str, device: str) -> str:
    """The collective backend to use, checked against what this machine has."""
    if name == "auto":
        return "nccl" if device.startswith("cuda") else "gloo"
    if name == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError("weights.backend='nccl' needs CUDA and a torch built with NCCL")
    if name == "hccl":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            raise ValueError(
                "weights.backend='hccl' needs torch_npu (pip install torch-npu)"
            ) from None
    if name not in ("gloo", "nccl", "hccl"):
        raise ValueError(f"{name!r} is not a collective backend (allowed: gloo, nccl, hccl)")
    return name


def new_weight_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Join the dedicated weight-sync group (blocks until every rank joined)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=timeout
    )
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    if backend == "hccl":
        import torch_npu

        return torch_npu._C._distributed_c10d.ProcessGroupHCCL(store, rank, world_size)
    raise ValueError(f"unknown weight-sync backend {backend!r} (allowed: gloo, nccl, hccl)")


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.broadcast([tensor], opts).wait()


def receive_flattened_bucket(
    group: dist.ProcessGroup,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    device: str | torch.device = "cpu",
) -> list[tuple[str, torch.Tensor]]:
    """Engine side of one bucket: receive the flat buffer and split it into named tensors."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError("names, dtypes and shapes must be non-empty and of equal length")
    if len(set(dtypes)) != 1:
        raise ValueError(f"a flattened bucket holds one dtype, got {sorted(set(dtypes))}")
    from asyncrl.transports.weights.bucket import TensorSpec

    specs = tuple(
        TensorSpec(n, d.removeprefix("torch."), tuple(s))
        for n, d, s in zip(names, dtypes, shapes, strict=True)
    )
    manifest = BucketManifest(specs, 0, 1)
    flat = torch.empty(manifest.numel, dtype=manifest.dtype, device=device)
    broadcast(group, flat, src=0)
    return unpack(flat, manifest)


class CollectiveWeightSender:
    """WeightTransport over a collective: snapshot on ``push``, stream in a background thread."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        cfg: WeightSyncConfig,
        backend: str,
        pause_mode: str = "abort",
        device: str = "cpu",
    ):
        if not engine_urls:
            raise ValueError("weight sync needs at least one engine URL")
        self._urls = list(engine_urls)
        self._cfg = cfg
        self._backend = backend
        self._pause_mode = pause_mode
        self._device = device
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="weight-sender", daemon=True
        )
        self._group: dist.ProcessGroup | None = None
        self._clients: list[SGLangClient] = []
        self._plan: list[BucketManifest] = []
        self._plan_key: tuple = ()
        self._staging: list[torch.Tensor] = []
        self._last: PushHandle | None = None

    # -- lifecycle ---------------------------------------------------------------------
    def connect(self) -> None:
        self._thread.start()
        self._run(self._connect()).result()

    def close(self) -> None:
        if self._last is not None and not self._last.done():
            try:
                self._last.wait(self._cfg.timeout_s)
            except WeightSyncError:
                pass
        if self._thread.is_alive():
            self._run(self._close_clients()).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._group = None

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _connect(self) -> None:
        port = free_port(self._cfg.master_address)
        world = 1 + len(self._urls)
        self._clients = [SGLangClient(u, timeout_s=self._cfg.timeout_s) for u in self._urls]
        await asyncio.gather(*(c.wait_healthy(self._cfg.timeout_s) for c in self._clients))
        calls = [
            c.init_weights_update_group(
                master_address=self._cfg.master_address,
                master_port=port,
                rank_offset=1 + i,
                world_size=world,
                group_name=self._cfg.group_name,
                backend=self._backend,
            )
            for i, c in enumerate(self._clients)
        ]
        own = asyncio.to_thread(
            new_weight_group,
            self._backend,
            self._cfg.master_address,
            port,
            0,
            world,
            self._cfg.group_name,
            self._cfg.timeout_s,
        )
        results = await asyncio.gather(own, *calls)
        self._group = results[0]

    async def _close_clients(self) -> None:
        await asyncio.gather(*(c.close() for c in self._clients), return_exceptions=True)

    # -- push --------------------------------------------------------------------------
    def push(self, named_weights: Iterable[tuple[str, torch.Tensor]], version: int) -> PushHandle:
        """Snapshot ``named_weights`` into staging buffers and stream them in the background."""
        assert self._group is not None, "connect() first"
        t0 = time.perf_counter()
        if self._last is not None:
            self._last.wait()  # staging buffers still in use by the previous push
        waited = time.perf_counter() - t0
        items = [(n, t.detach()) for n, t in named_weights]
        specs = [spec_of(n, t) for n, t in items]
        if tuple(specs) != self._plan_key:
            self._plan_key = tuple(specs)
            self._plan = plan_buckets(specs, self._cfg.bucket_mb << 20)
            self._staging = [
                torch.empty(b.numel, dtype=b.dtype, device=self._device) for b in self._plan
            ]
        by_name = dict(items)
        for bucket, flat in zip(self._plan, self._staging, strict=True):
            pack_into(flat, (by_name[s.name] for s in bucket.specs))
        snapshot_s = time.perf_counter() - t0
        fut = self._run(self._send(version, waited, snapshot_s))
        self._last = PushHandle(version, fut)
        return self._last

    async def _send(self, version: int, waited_s: float, snapshot_s: float) -> dict[str, float]:
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(c.pause_generation(self._pause_mode) for c in self._clients))
            for bucket, flat in zip(self._plan, self._staging, strict=True):
                last = bucket.index == bucket.count - 1
                calls = [
                    c.update_weights_from_distributed(
                        names=[s.name for s in bucket.specs],
                        dtypes=[s.dtype for s in bucket.specs],
                        shapes=[list(s.shape) for s in bucket.specs],
                        group_name=self._cfg.group_name,
                        load_format="flattened_bucket",
                        flush_cache=last,
                        weight_version=str(version) if last else None,
                    )
                    for c in self._clients
                ]
                await asyncio.gather(asyncio.to_thread(broadcast, self._group, flat), *calls)
        finally:
            await asyncio.gather(
                *(c.continue_generation() for c in self._clients), return_exceptions=True
            )
        nbytes = sum(b.nbytes for b in self._plan)
        return {
            "sync_s": time.perf_counter() - t0,
            "snapshot_s": snapshot_s,
            "push_wait_s": waited_s,
            "bytes": float(nbytes),
            "buckets": float(len(self._plan)),
        }
