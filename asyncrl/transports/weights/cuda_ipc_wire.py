"""CUDA IPC weight transport for engines colocated on the trainer's GPU(s): the protocol.

The bytes move once. This module is the wire both sides share (the request's
``load_format``, how a CUDA storage and a dtype are written in the JSON descriptor);
the trainer's side is ``cuda_ipc_send`` (:class:`CudaIpcWeightSender`,
:class:`IpcExport`), the engine's side ``cuda_ipc_recv`` (:class:`IpcReceiver`).

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
- **Engine side** (``cuda_ipc_recv.IpcReceiver``): opens each segment once
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

import base64
from typing import Any

import torch

__all__ = ["LOAD_FORMAT", "b64", "dtype_name", "dtype_of", "open_storage", "share_storage", "unb64"]

LOAD_FORMAT = "asyncrl_ipc"
"""``load_format`` of asyncrl's CUDA IPC requests (the descriptor is in ``asyncrl_ipc``)."""


def b64(raw: bytes | None) -> str | None:
    """Bytes (an IPC handle) as JSON text; None stays None."""
    return None if raw is None else base64.b64encode(raw).decode()


def unb64(text: str | None) -> bytes | None:
    """The inverse of :func:`b64`."""
    return None if text is None else base64.b64decode(text)


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the layout writes it (``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """The dtype a layout names; ValueError for a name that is not a torch dtype."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in the IPC layout")
    return dtype


def share_storage(storage: torch.UntypedStorage) -> dict[str, Any]:
    """The JSON descriptor of one CUDA storage (its segment's IPC handle and its offset)."""
    (_, handle, size, offset, ref, ref_offset, event, event_sync) = storage._share_cuda_()
    return {
        "handle": b64(handle),
        "size": int(size),
        "offset": int(offset),
        "ref": b64(ref),
        "ref_offset": int(ref_offset),
        "event": b64(event),
        "event_sync": bool(event_sync),
    }


def open_storage(device_index: int, s: dict[str, Any]) -> torch.UntypedStorage:
    """Map the storage :func:`share_storage` described, on CUDA device ``device_index``
    (``cudaIpcOpenMemHandle``; torch caches the opened segment while a storage of it lives)."""
    return torch.UntypedStorage._new_shared_cuda(
        device_index, unb64(s["handle"]), int(s["size"]), int(s["offset"]),
        unb64(s["ref"]), int(s["ref_offset"]), unb64(s["event"]), bool(s["event_sync"]),
    )  # fmt: skip
