"""CUDA IPC weight transport for engines colocated on the trainer's GPU(s): the bytes move once.

A sync is one device-to-device read of the trainer's tensors and one write into
the engine's standby parameters; nothing is staged on the sender.

- **Export, once per layout.** The sender exports the CUDA storages that hold
  the pushed tensors (``storage._share_cuda_()``: handle of the caching-allocator
  segment + the storage's byte offset in it) and describes every tensor by
  (storage, element offset, dtype, shape, stride). That *layout* gets an id;
  it is re-exported only when a tensor's storage, dtype, shape or stride
  changes. The sender holds a reference to every exported storage while its
  layout is current, so the memory an engine maps is never reused under it.
- **One control call per sync** (one engine): ``/update_weights_from_tensor``
  with ``load_format="asyncrl_ipc"`` and an ``asyncrl_ipc`` JSON object
  (never pickle): version, layout id (the full layout only when that engine
  has not mapped it yet), the sender's interprocess CUDA event, recorded in
  ``push`` on the trainer's current stream (the engine's copy waits for it, so
  the trainer never synchronizes), and ``commit``.
- **Engine side** (:class:`IpcReceiver`): opens each segment once
  (``cudaIpcOpenMemHandle`` is slow) and keeps the mapped tensors while the
  layout is current; a sync is one ``torch._foreach_copy_`` from the trainer's
  tensors into the engine's standby parameter set on a side stream, then the
  model switches to the standby set between two decoding steps (zero copy, as
  on CPU) and the old parameters become the next standby set. With several
  engines the copy and the switch are two phases (``/update_weight_version``
  commits once every engine copied), so all switch or none do.
- **Ordering.** The trainer may run its next forward/backward while engines
  copy; its next optimizer step waits (``PushHandle.wait_snapshot``) until
  every engine has copied and answered.
- **Checksums** (``weights.ipc_verify``, default off): the bytes never leave
  the GPU's memory, so there is no link to corrupt them, and a checksum costs
  a full extra read of the weights on each side (as much as the copy itself).
  When on, the sender sends one checksum per tensor and the engine checks its
  copies before switching.

Failure semantics are those of every transport: any error (an unmapped layout,
a failed copy, a checksum mismatch) leaves the engine on its old weights and
version and fails the push; the next push re-sends the layout.

SGLang's own ``/update_weights_from_tensor`` expects pickled tensors, which
this project does not put on a wire; use the collective transport with SGLang.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

import torch

from asyncrl.transports.weights.base import PushHandle
from asyncrl.transports.weights.bucket import checksum
from asyncrl.transports.weights.sender import BucketSender

__all__ = ["LOAD_FORMAT", "CudaIpcWeightSender", "IpcExport", "IpcReceiver"]

LOAD_FORMAT = "asyncrl_ipc"
"""``load_format`` of asyncrl's CUDA IPC requests (the descriptor is in ``asyncrl_ipc``)."""


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in the IPC layout")
    return dtype


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
                desc = old[1] if old is not None else _share(storage)
                held[ptr] = (storage, desc)
                index[ptr] = len(segments)
                segments.append(desc)
            dtype = str(t.dtype).removeprefix("torch.")
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


def _share(storage: torch.UntypedStorage) -> dict[str, Any]:
    """The JSON descriptor of one CUDA storage (its segment's IPC handle and its offset)."""
    (_, handle, size, offset, ref, ref_offset, event, event_sync) = storage._share_cuda_()
    return {
        "handle": _b64(handle),
        "size": int(size),
        "offset": int(offset),
        "ref": _b64(ref),
        "ref_offset": int(ref_offset),
        "event": _b64(event),
        "event_sync": bool(event_sync),
    }


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bitwise(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer views of a same-dtype pair, so the copy moves bits (a float copy may rewrite
    NaN payloads): flat and as wide as alignment allows when both are contiguous (fewer,
    wider loads); a pair that needs a cast stays as it is."""
    if src.dtype != dst.dtype or dst.is_complex() or dst.element_size() not in _BITS:
        return dst, src
    if dst.is_contiguous() and src.is_contiguous():
        nbytes = dst.numel() * dst.element_size()
        for width in (8, 4, 2, 1):
            if nbytes % width == 0 and (dst.data_ptr() | src.data_ptr()) % width == 0:
                bits = _BITS[width]
                return (
                    dst.reshape(-1).view(torch.uint8).view(bits),
                    src.reshape(-1).view(torch.uint8).view(bits),
                )
    bits = _BITS[dst.element_size()]
    return dst.view(bits), src.view(bits)


class IpcReceiver:
    """Engine side: the sender's tensors mapped through CUDA IPC, copied into a standby set.

    Keeps one layout (the last one sent); a new one is mapped before the old one is
    dropped, so segments that stay in it are not re-opened (torch caches opened
    handles while a storage of that segment lives). Two parameter sets alternate:
    the live one (the model's) and the standby one that the next update is copied
    into; the first standby set is allocated, the second is the model's original
    parameters. The standby set is never the model's (only :meth:`switched` swaps).
    """

    def __init__(self, device: torch.device, params: dict[str, torch.nn.Parameter]):
        if device.type != "cuda":
            raise ValueError("cuda-ipc needs the engine on a CUDA device (--device cuda)")
        self.device = device
        self.params = params
        self.layout_id: str | None = None
        self.names: list[str] = []
        self.sources: list[torch.Tensor] = []
        self._sets: list[dict[str, torch.Tensor]] = []  # [allocated, original parameters]
        self._standby = 0
        self._pairs: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._events: dict[str, torch.cuda.Event] = {}
        self._released: torch.cuda.Event | None = None  # last read of the standby set
        self._stream = torch.cuda.Stream(device)
        self._copied = torch.cuda.Event()

    def map(self, desc: dict[str, Any]) -> bool:
        """Map ``desc``'s layout unless it is the current one; True when newly mapped."""
        layout_id = str(desc.get("layout"))
        if layout_id == self.layout_id:
            return False
        if desc.get("tensors") is None or desc.get("segments") is None:
            raise ValueError(f"unknown IPC layout {layout_id}: the sender must send it again")
        index = self.device.index if self.device.index is not None else 0
        storages = [
            torch.UntypedStorage._new_shared_cuda(
                index, _unb64(s["handle"]), int(s["size"]), int(s["offset"]),
                _unb64(s["ref"]), int(s["ref_offset"]), _unb64(s["event"]), bool(s["event_sync"]),
            )
            for s in desc["segments"]
        ]  # fmt: skip
        names, sources = [], []
        for name, seg, offset, dtype, shape, stride in desc["tensors"]:
            t = torch.empty(0, dtype=_dtype(dtype), device=self.device)
            sources.append(t.set_(storages[int(seg)], int(offset), tuple(shape), tuple(stride)))
            names.append(str(name))
        if names != self.names:  # other parameters: start over with two fresh sets
            self._sets, self._standby = [], 0
        self.layout_id, self.names, self.sources = layout_id, names, sources
        self._pairs, self._graphs = {}, {}
        return True

    def launch(self, event: str | None, how: str = "graph") -> list[tuple[str, torch.Tensor]]:
        """Start copying the mapped tensors into the standby set on the side stream, after
        the sender's ``event``; returns the standby set (complete once :meth:`wait` returns,
        or for kernels queued behind :meth:`order_after_copy`).

        ``how``: ``foreach`` (one multi-tensor copy) or ``graph`` (the per-tensor copies
        captured once per layout and set as a CUDA graph, then replayed).
        """
        if not self._sets:  # the standby set and the model's current parameters
            live = {n: self.params[n].data for n in self.names}
            self._sets = [{n: torch.empty_like(t) for n, t in live.items()}, live]
        standby = self._sets[self._standby]
        if self._standby not in self._pairs:  # per layout and set: the bitwise views, once
            views = [_bitwise(standby[n], s) for n, s in zip(self.names, self.sources, strict=True)]
            self._pairs[self._standby] = ([d for d, _ in views], [s for _, s in views])
        stream, pairs = self._stream, self._pairs[self._standby]
        graph = None
        if how == "graph":
            graph = self._graphs.get(self._standby) or self._capture(pairs)
            self._graphs[self._standby] = graph
        with torch.cuda.stream(stream), torch.no_grad():
            if self._released is not None:
                stream.wait_event(self._released)  # the model's last reads of these are done
            sender = self.event(event)
            if sender is not None:
                stream.wait_event(sender)  # the trainer's writes of these weights are done
            if graph is not None:
                graph.replay()
            else:
                torch._foreach_copy_(*pairs)
            self._copied.record(stream)
        return [(n, standby[n]) for n in self.names]

    def order_after_copy(self) -> None:
        """Make the engine's (current) stream run later kernels only after the copy."""
        torch.cuda.current_stream(self.device).wait_event(self._copied)

    def wait(self) -> None:
        """Block until the copy is done (the sender may then write its tensors again)."""
        self._copied.synchronize()

    def _capture(self, pairs: tuple[list[torch.Tensor], list[torch.Tensor]]) -> Any:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream), torch.no_grad():
            graph.capture_begin(capture_error_mode="thread_local")  # other threads may run
            try:
                for dst, src in zip(*pairs, strict=True):
                    dst.copy_(src)
            finally:
                graph.capture_end()
        return graph

    def switched(self) -> None:
        """The model now holds the standby set: the other set becomes the standby set."""
        self._standby = 1 - self._standby
        self._released = torch.cuda.Event()
        self._released.record(torch.cuda.current_stream(self.device))

    def release(self) -> None:
        """Drop the sender's mapped tensors and events (the sender closes); keep both sets."""
        self.layout_id, self.sources = None, []  # names stay: the sets fit the next layout
        self._pairs, self._graphs, self._events = {}, {}, {}

    def event(self, handle: str | None) -> torch.cuda.Event | None:
        """The sender's interprocess event (opened once per handle)."""
        if handle is None:
            return None
        if handle not in self._events:
            raw = _unb64(handle)
            assert raw is not None
            self._events[handle] = torch.cuda.Event.from_ipc_handle(self.device, raw)
        return self._events[handle]


class CudaIpcWeightSender(BucketSender):
    """WeightTransport by CUDA IPC into colocated engines (see module docstring)."""

    def __init__(self, engine_urls: Any, cfg: Any, pause_mode: str = "abort", device: str = "cuda"):
        if not (device.startswith("cuda") and torch.cuda.is_available()):
            raise ValueError("weights.backend='cuda-ipc' needs the trainer on a CUDA device "
                             "(trainer.device='cuda') and engines on the same GPU(s)")  # fmt: skip
        super().__init__(engine_urls, cfg, device=device, pause_mode=pause_mode)
        self._export = IpcExport()
        self._mapped: set[str] = set()  # engines that hold the current layout
        self._event = torch.cuda.Event(interprocess=True)
        self._event_handle = _b64(self._event.ipc_handle())

    async def _form(self) -> None:
        self._mapped = set()

    async def _teardown(self) -> None:
        """Engines drop what they mapped of this sender (best effort: they may be gone)."""
        self._mapped = set()
        release = {"release": True}
        await asyncio.gather(
            *(
                c.update_weights_from_tensor(
                    [], load_format=LOAD_FORMAT, extra={"asyncrl_ipc": release}
                )
                for c in self.clients
            ),
            return_exceptions=True,
        )

    def close(self) -> None:
        super().close()
        self._export.clear()

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
        handle = PushHandle(version, self._run(self._push_ipc(items, version, snap, t0)), snap)
        self._last = handle
        if self.cfg.snapshot:
            handle.wait_snapshot()
        return handle

    async def _push_ipc(
        self, items: list[tuple[str, torch.Tensor]], version: int, snap: threading.Event, t0: float
    ) -> dict[str, float]:
        assert self._lock is not None, "connect() first"
        async with self._lock:
            t1 = time.perf_counter()
            try:
                if not self._formed:
                    await self._reform_locked()
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
        single = len(self.clients) == 1
        scope = self.cfg.pause_scope
        pause = {"mode": self.pause_mode, "scope": scope} if single else None
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
            await self._all("/pause_generation", lambda c: c.pause_generation(self.pause_mode))
        try:
            calls = [
                c.update_weights_from_tensor(
                    serialized_named_tensors=[],
                    load_format=LOAD_FORMAT,
                    weight_version=str(version) if single else None,
                    extra={"asyncrl_ipc": base if c.url in self._mapped else full},
                )
                for c in self.clients
            ]
            results = await asyncio.gather(*calls, return_exceptions=True)
            urls = [c.url for c in self.clients]
            self._raise_failed(list(zip(urls, results, strict=True)), prefix=f"v{version}: ")
            self._mapped = {c.url for c in self.clients}
            if not single:
                await self._commit(version)
        finally:
            if paused:
                await self._resume_all()
        timings = [r.get("timing") or {} for r in results if isinstance(r, dict)]
        keys = {k for t in timings for k in t}
        return {k: max(float(t.get(k, 0.0)) for t in timings) for k in keys}
