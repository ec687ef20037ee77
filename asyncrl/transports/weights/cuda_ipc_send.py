"""CUDA IPC weight transport, trainer side: the sender and the export of its tensors.

Runs in the trainer process. The protocol (what a sync sends, failure semantics) is in
``cuda_ipc_wire``; the engine's side is ``cuda_ipc_recv``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch

from asyncrl.config import CudaIpcWeightsConfig
from asyncrl.transports.weights.base import PushHandle
from asyncrl.transports.weights.bucket import checksum
from asyncrl.transports.weights.cuda_ipc_wire import LOAD_FORMAT, b64, dtype_name, share_storage
from asyncrl.transports.weights.seam import TensorHandoff, TensorLoad, WeightAdapter
from asyncrl.transports.weights.send_engines import EngineGroup, GroupSender, settle

__all__ = ["CudaIpcWeightSender", "IpcExport"]

log = logging.getLogger("asyncrl.weights")


class IpcExport:
    """Sender side: the exported storages and the layout of the pushed tensors."""

    def __init__(self) -> None:
        self._key: list[Any] = []
        self._held: dict[int, tuple[torch.UntypedStorage, dict[str, Any]]] = {}
        self.layout: dict[str, Any] = {}
        self.nbytes = 0

    @property
    def layout_id(self) -> str:
        return str(self.layout.get("id", ""))

    def update(self, items: list[tuple[str, torch.Tensor]]) -> bool:
        """Describe ``items``; export storages not exported yet. True when the layout changed.

        Raises ValueError for a tensor that is not on a CUDA device.
        """
        key = [(n, t.data_ptr(), t.dtype, t.shape, t.stride()) for n, t in items]
        if key == self._key:
            return False
        held: dict[int, tuple[torch.UntypedStorage, dict[str, Any]]] = {}
        index: dict[int, int] = {}
        segments: list[dict[str, Any]] = []
        tensors: list[list[Any]] = []
        for name, t in items:
            if t.device.type != "cuda":
                raise ValueError(f"cuda-ipc pushes CUDA tensors; {name} is on {t.device}")
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in index:
                old = self._held.get(ptr)
                desc = old[1] if old is not None else share_storage(storage)
                held[ptr] = (storage, desc)
                index[ptr] = len(segments)
                segments.append(desc)
            dtype = dtype_name(t.dtype)
            tensors.append(
                [name, index[ptr], t.storage_offset(), dtype, list(t.shape), list(t.stride())]
            )
        self._held = held  # storages out of the layout are released (engines drop them too)
        self.layout = {"id": uuid.uuid4().hex, "segments": segments, "tensors": tensors}
        self.nbytes = sum(t.numel() * t.element_size() for _, t in items)
        self._key = key
        return True

    def clear(self) -> None:
        self._key, self._held, self.layout = [], {}, {}


class CudaIpcWeightSender(GroupSender):
    """WeightTransport by CUDA IPC into colocated engines (see ``cuda_ipc_wire``): one
    control call per engine and sync, over an :class:`EngineGroup` (``engines``), whose
    :class:`~asyncrl.transports.weights.send_engines.Formation` it is."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        cfg: CudaIpcWeightsConfig,
        family: WeightAdapter,
        pause_mode: str = "abort",
        device: str = "cuda",
    ):
        if not (device.startswith("cuda") and torch.cuda.is_available()):
            raise ValueError("weights.backend='cuda-ipc' needs the trainer on a CUDA device "
                             "(trainer.device='cuda') and engines on the same GPU(s)")  # fmt: skip
        self.cfg = cfg
        self.device = torch.device(device)
        self.engines = EngineGroup(engine_urls, cfg, self, family, pause_mode=pause_mode)
        self._last: PushHandle | None = None
        self._snap_at = 0.0
        self._export = IpcExport()
        self._mapped: set[str] = set()  # engines that hold the current layout
        self._event = torch.cuda.Event(interprocess=True)
        self._event_handle = b64(self._event.ipc_handle())

    # -- WeightTransport (connect, engines_changed: GroupSender) ----------------------------
    def close(self) -> None:
        """Wait for the push in flight; engines unmap this sender's tensors; stop."""
        settle(self._last, self.cfg.timeout_s)
        self.engines.close()
        self._export.clear()

    # -- Formation -----------------------------------------------------------------------
    def client_timeout_s(self) -> float:
        """An engine's answer (a whole sync) may take ``weights.timeout_s`` beyond the push's
        own budget (``timeout_s``)."""
        return 2 * self.cfg.timeout_s

    async def form(self) -> None:
        self._mapped = set()

    async def teardown(self) -> None:
        """Engines drop what they mapped of this sender (best effort: they may be gone)."""
        self._mapped = set()
        release = {"release": True}
        await asyncio.gather(
            *(
                _handoff(c).update_weights_from_tensor(
                    TensorLoad([], load_format=LOAD_FORMAT, extra={"asyncrl_ipc": release})
                )
                for c in self.engines.clients
            ),
            return_exceptions=True,
        )

    def push(self, named_weights: Iterable[tuple[str, torch.Tensor]], version: int) -> PushHandle:
        """Record the trainer's stream and hand the tensors' references to the sender thread.

        The caller must not write the tensors until ``wait_snapshot()`` returns (with
        ``snapshot=True``: until ``push`` returns, which then waits for every engine's copy).
        """
        t0 = time.perf_counter()
        items = list(named_weights)
        if not items:
            raise ValueError("push() got no tensors")
        self._event.record(torch.cuda.current_stream(self.device))  # the weights are final here
        snap = threading.Event()
        fut = self.engines.run(self._push_ipc(items, version, snap, t0))
        handle = PushHandle(version, fut, snap)
        self._last = handle
        if self.cfg.snapshot:
            handle.wait_snapshot()
        return handle

    async def _push_ipc(
        self, items: list[tuple[str, torch.Tensor]], version: int, snap: threading.Event, t0: float
    ) -> dict[str, float]:
        assert self.engines.lock is not None, "connect() first"
        async with self.engines.lock:
            t1 = time.perf_counter()
            try:
                if not self.engines.formed:
                    await self.engines.reform_locked()
                if self._export.update(items):
                    self._mapped = set()
                t2 = time.perf_counter()
                verify = None
                if self.cfg.ipc_verify:  # after the trainer's writes, on this thread's stream
                    torch.cuda.current_stream(self.device).wait_event(self._event)
                    verify = [checksum(t.contiguous()) for _, t in items]
                t3 = time.perf_counter()
                timing = await self._deliver_ipc(version, verify)
                self._snap_at = time.perf_counter()
            except BaseException:
                self._mapped = set()  # re-send the layout next time
                raise
            finally:
                snap.set()
            return {
                "sync_s": time.perf_counter() - t0,
                "push_wait_s": t1 - t0,
                "snapshot_s": self._snap_at - t0,
                "bytes": float(self._export.nbytes),
                "buckets": 1.0,
                "export_s": t2 - t1,
                "checksum_s": t3 - t2,
                "deliver_s": self._snap_at - t3,
                **{f"engine_{k}": v for k, v in timing.items()},
            }

    async def _deliver_ipc(self, version: int, verify: list[int] | None) -> dict[str, float]:
        """One call per engine (plus the commit with several engines); the slowest engine's
        timing (seconds by phase, as it reported them)."""
        clients = self.engines.clients
        single = len(clients) == 1
        scope = self.cfg.pause_scope
        pause = {"mode": self.engines.pause_mode, "scope": scope} if single else None
        base = {
            "version": version,
            "layout": self._export.layout_id,
            "event": self._event_handle,
            "commit": single,
            "pause": pause,
            "verify": verify,
            "copy": self.cfg.ipc_copy,
        }
        full = {**base, **self._export.layout, "layout": self._export.layout_id}
        paused = not single and scope == "transfer"
        if paused:
            await self.engines.pause()
        try:
            calls = [
                _handoff(c).update_weights_from_tensor(
                    TensorLoad(
                        serialized_named_tensors=[],
                        load_format=LOAD_FORMAT,
                        weight_version=str(version) if single else None,
                        extra={"asyncrl_ipc": base if c.url in self._mapped else full},
                    )
                )
                for c in clients
            ]
            results = await asyncio.gather(*calls, return_exceptions=True)
            urls = [c.url for c in clients]
            self.engines.raise_failed(list(zip(urls, results, strict=True)), prefix=f"v{version}: ")
            self._mapped = set(urls)
            if not single:
                await self.engines.commit(version)
        finally:
            if paused:
                await self.engines.resume()
        timings = [r.get("timing") or {} for r in results if isinstance(r, dict)]
        keys = {k for t in timings for k in t}
        return {k: max(float(t.get(k, 0.0)) for t in timings) for k in keys}


def _handoff(engine: object) -> TensorHandoff:
    """The engine's IPC hand-off (the factory gives ``cuda-ipc`` only families that have it:
    ``WeightAdapter.no_ipc`` empty)."""
    assert hasattr(engine, "update_weights_from_tensor"), f"{engine!r} takes no IPC hand-off"
    return cast(TensorHandoff, engine)
