"""CUDA IPC weight transport for engines colocated on the trainer's GPU(s).

The sender packs each bucket into one of two GPU staging slots (as every
sender does) and posts ``/update_weights_from_tensor`` with
``load_format="flattened_bucket"``: ``serialized_named_tensors`` holds one JSON
descriptor of the slot's CUDA IPC handle (never pickle: the descriptor names
the dtype, sizes and the handle bytes in base64) and ``asyncrl_bucket`` the
manifest. The engine maps the slot once (handles are cached per slot), copies
the bucket out device to device, verifies and stages it like any other
bucket. A slot is reused only after every engine answered for it.

SGLang's own ``/update_weights_from_tensor`` expects pickled tensors, which
this project does not put on a wire; use the collective transport with SGLang.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import torch

from asyncrl.transports.weights.bucket import BucketManifest
from asyncrl.transports.weights.sender import Acks, BucketSender, bucket_extra

__all__ = ["CudaIpcWeightSender", "encode_ipc", "read_ipc_bucket"]

_opened: dict[str, torch.Tensor] = {}  # engine side: mapped sender slots by handle


def encode_ipc(slot: torch.Tensor) -> dict[str, Any]:
    """A JSON-able descriptor of a CUDA tensor's storage that another process can map."""
    from torch.multiprocessing.reductions import reduce_tensor

    if slot.device.type != "cuda":
        raise ValueError("CUDA IPC needs a CUDA tensor")
    _, args = reduce_tensor(slot)
    (_, size, stride, offset, _, dtype, device, handle, storage_bytes, storage_offset, _,
     ref_handle, ref_offset, event_handle, event_sync) = args  # fmt: skip
    b64 = lambda b: None if b is None else base64.b64encode(b).decode()  # noqa: E731
    return {
        "size": list(size),
        "stride": list(stride),
        "offset": offset,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "handle": b64(handle),
        "storage_bytes": storage_bytes,
        "storage_offset": storage_offset,
        "ref_handle": b64(ref_handle),
        "ref_offset": ref_offset,
        "event_handle": b64(event_handle),
        "event_sync": event_sync,
    }


def _open(desc: dict[str, Any]) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    key = f"{desc['handle']}@{desc['storage_offset']}"  # slots may share one CUDA allocation
    if key not in _opened:
        unb64 = lambda s: None if s is None else base64.b64decode(s)  # noqa: E731
        _opened[key] = rebuild_cuda_tensor(
            torch.Tensor, tuple(desc["size"]), tuple(desc["stride"]), desc["offset"],
            torch.UntypedStorage, getattr(torch, desc["dtype"]), desc["device"],
            unb64(desc["handle"]), desc["storage_bytes"], desc["storage_offset"], False,
            unb64(desc["ref_handle"]), desc["ref_offset"], unb64(desc["event_handle"]),
            desc["event_sync"],
        )  # fmt: skip
    return _opened[key]


def read_ipc_bucket(serialized: str, flat: torch.Tensor) -> None:
    """Engine side: copy the bucket described by ``serialized`` into ``flat`` (device copy)."""
    desc = json.loads(serialized)
    src = _open(desc["slot"]).view(torch.uint8)
    nbytes = flat.numel() * flat.element_size()
    if desc["nbytes"] != nbytes:
        raise ValueError(f"IPC bucket has {desc['nbytes']} bytes, manifest needs {nbytes}")
    flat.view(torch.uint8).copy_(src[: desc["nbytes"]])
    torch.cuda.current_stream(flat.device).synchronize()


class CudaIpcWeightSender(BucketSender):
    """WeightTransport by CUDA IPC into colocated engines (see module docstring)."""

    def __init__(self, engine_urls: Any, cfg: Any, pause_mode: str = "abort", device: str = "cuda"):
        if not (device.startswith("cuda") and torch.cuda.is_available()):
            raise ValueError("weights.backend='cuda-ipc' needs the trainer on a CUDA device "
                             "(trainer.device='cuda') and engines on the same GPU(s)")  # fmt: skip
        super().__init__(engine_urls, cfg, device=device, pause_mode=pause_mode)
        self._descs: dict[int, dict[str, Any]] = {}

    async def _form(self) -> None:
        self._descs = {}  # engines map each slot on first use

    async def _teardown(self) -> None:
        self._descs = {}

    async def _send_bucket(self, m: BucketManifest, flat: torch.Tensor) -> Acks:
        slot = self._slots[m.index % len(self._slots)]
        if slot.data_ptr() not in self._descs:
            self._descs[slot.data_ptr()] = encode_ipc(slot)
        payload = json.dumps({"slot": self._descs[slot.data_ptr()], "nbytes": m.nbytes})
        acks: Acks = [
            (
                c.url,
                asyncio.ensure_future(
                    c.update_weights_from_tensor(
                        serialized_named_tensors=[payload],
                        load_format="flattened_bucket",
                        flush_cache=m.index == m.count - 1,
                        extra={
                            "asyncrl_bucket": bucket_extra(m),
                            "names": [e.name for e in m.entries],
                            "dtypes": [m.dtype] * len(m.entries),
                            "shapes": [e.wire_shape for e in m.entries],
                        },
                    )
                ),
            )
            for c in self.clients
        ]
        await asyncio.wait([t for _, t in acks])  # the slot is free once every engine copied
        return acks
