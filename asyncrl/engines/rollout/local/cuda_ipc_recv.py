"""CUDA IPC weight transport, engine side: the sender's tensors mapped and copied in.

Runs in the engine process (the embedded engine's ``WeightReceiver`` drives it). The
protocol is in ``cuda_ipc_wire``; the trainer's side is ``cuda_ipc_send``.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.transports.weights.cuda_ipc_wire import dtype_of, open_storage, unb64

__all__ = ["IpcReceiver"]

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
        storages = [open_storage(index, s) for s in desc["segments"]]
        names, sources = [], []
        for name, seg, offset, dtype, shape, stride in desc["tensors"]:
            t = torch.empty(0, dtype=dtype_of(dtype), device=self.device)
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
            raw = unb64(handle)
            assert raw is not None
            self._events[handle] = torch.cuda.Event.from_ipc_handle(self.device, raw)
        return self._events[handle]
