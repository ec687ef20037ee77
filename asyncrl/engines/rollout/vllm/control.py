"""The weight transport's control of a vLLM 0.33 engine (:class:`VLLMControl`).

vLLM's RL routes (``rl`` = ``vllm/entrypoints/rl/online/api_router.py``, mounted only with
``VLLM_SERVER_DEV_MODE=1``), called with the bodies of vLLM's own HTTP weight-sync client
(``vllm/distributed/weight_transfer/clients.py:58-96``), mapped onto
:class:`~asyncrl.engines.rollout.base.EngineControl`:

- *form*: ``GET /get_world_size`` (TP·PP·DP ranks, rl:269-289) is the engine's rank count;
  ``POST /init_weight_transfer_engine {"init_info": {master_address, master_port,
  rank_offset, world_size, packed, packed_buffer_size_bytes, packed_num_buffers}}``
  (rl:162-171; fields of ``NCCLWeightTransferInitInfo``, nccl_common.py:75-107; unknown
  fields are refused, base.py:517-535). Each worker joins as ``rank_offset + dp·TP·PP +
  rank`` (nccl_common.py:239-244) through a ``StatelessProcessGroup`` whose TCP store rank 0
  (the trainer) hosts (vllm/distributed/utils.py:537-581); the trainer joins concurrently
  with the HTTP call (nccl_common.py:150-158). Several engines: offsets ``1 + Σ ranks`` of
  the engines before. Once per group: a re-init clears the metadata cache
  (nccl_engine.py:159-165).
- *session*: ``POST /start_weight_update`` (no body; a start during a session fails,
  gpu_worker.py:1569-1573) ... ``POST /finish_weight_update {"weight_version": v}`` (sets
  the version with the finish, v1/engine/async_llm.py:1432-1436; without a session it
  fails, gpu_worker.py:1638-1641).
- *announce*: ``POST /update_weights {"update_info": {names, dtype_names, shapes}}``
  (rl:195-204), in flight while the trainer broadcasts (nccl_engine.py:370-382). The
  workers cut what one call receives into packed chunks: a chunk closes after the tensor
  that takes it over ``packed_buffer_size_bytes``, or at the call's last tensor
  (packed_tensor.py:259-284); ``packed_buffer_size_bytes`` is set to the transport's bucket
  size, so every bucket (at most that size, or one tensor) is exactly one chunk: one
  broadcast of its bytes, which are vLLM's packed layout (tensors' bytes back to back,
  packed_tensor.py:100-140). Empty lists reuse the previous call's metadata
  (nccl_engine.py:93-96, 201-204): sent only when this call's metadata equals the last one
  this engine took since the group formed and no call failed since. A failed update ends
  the session and leaves the model mid-reload (gpu_worker.py:1616-1631), ``/health`` still
  200: the transport re-sends the whole push as a new round.
- *version*: the finish sets it; :meth:`update_weight_version` only confirms that the
  session's finish did (vLLM's ``/update_weight_version``, rl:217-223, would relabel
  weights a failed finish left mid-reload: never called).
- *leave*: ``POST /shutdown_weight_transfer_engine`` (rl:174-178).
- verify: ``POST /weight_checker {"action": "checksum"}``: sha256 of every loaded tensor's
  bytes per worker, keys prefixed ``dp:pp:pcp:tp:`` (rl:232-266,
  model_loader/weight_checksum.py:32-38, gpu_worker.py:380-391): :meth:`weight_checksums`.
"""

from __future__ import annotations

import math
from typing import Any

from asyncrl.engines.rollout.base import BucketAnnouncement, EngineError, GroupSpec
from asyncrl.engines.rollout.vllm.client import VLLMClient

__all__ = ["DTYPE_BYTES", "VLLMControl", "packed_chunks"]

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1}
NUM_BUFFERS = 2  # DEFAULT_PACKED_NUM_BUFFERS (packed_tensor.py:16): the receiver's streams


def packed_chunks(sizes: list[int], cap: int) -> list[list[int]]:
    """vLLM's chunk-closing rule over tensors of ``sizes`` bytes (packed_tensor.py:259-284,
    the producer's at 100-127): indexes of each chunk; a chunk closes after the tensor that
    takes its total over ``cap``, the last one at the end."""
    chunks: list[list[int]] = [[]]
    total = 0
    for i, size in enumerate(sizes):
        chunks[-1].append(i)
        total += size
        if total > cap:
            chunks.append([])
            total = 0
    return [c for c in chunks if c]


class VLLMControl(VLLMClient):
    """A vLLM engine as the weight transport drives it (module docstring)."""

    def __init__(
        self, base_url: str, timeout_s: float = 120.0, bucket_bytes: int = 1 << 30, **kw: Any
    ):
        super().__init__(base_url, timeout_s, **kw)
        self.bucket_bytes = bucket_bytes
        self._meta: Any = None  # the metadata this engine holds (None: unknown)
        self._finished: str | None = None  # the version the last finish set
        self._open: bool | None = None  # a session is open (None: unknown)

    async def get_server_info(self) -> dict[str, Any]:
        """``tp_size``: ranks the engine joins the weight group with (``/get_world_size``)."""
        out = await self._call("GET", "/get_world_size", None, {"include_dp": "true"})
        if not isinstance(out, dict) or not isinstance(out.get("world_size"), int):
            raise EngineError("/get_world_size", 200, f"unexpected response: {out!r:.200}")
        return {"tp_size": out["world_size"], "version": "vllm"}

    async def init_weights_update_group(self, group: GroupSpec) -> None:
        """Join as ranks ``rank_offset ..`` (returns once the workers joined); vLLM's group
        has no name and its backend is NCCL."""
        self._meta, self._finished = None, None
        info = {
            "master_address": str(group.master_address),
            "master_port": int(group.master_port),
            "rank_offset": int(group.rank_offset),
            "world_size": int(group.world_size),
            "packed": True,
            "packed_buffer_size_bytes": int(self.bucket_bytes),
            "packed_num_buffers": NUM_BUFFERS,
        }
        await self._call("POST", "/init_weight_transfer_engine", {"init_info": info})

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._meta = None
        await self._call("POST", "/shutdown_weight_transfer_engine")

    async def begin_weight_update(self) -> bool:
        self._finished, self._open = None, None  # a refused start: one may be open
        await self._call("POST", "/start_weight_update")
        self._open = True
        return True

    async def update_weights_from_distributed(self, bucket: BucketAnnouncement) -> None:
        """Announce one bucket (one packed chunk, see module docstring); answers once every
        worker received and loaded it. Only names, dtypes and shapes are sent: the rest is
        SGLang's (vLLM refuses unknown fields)."""
        names, shapes = bucket.names, bucket.shapes
        dtype_names = [str(d).removeprefix("torch.") for d in bucket.dtypes]
        sizes = [math.prod(s) * DTYPE_BYTES[d] for s, d in zip(shapes, dtype_names, strict=True)]
        if len(packed_chunks(sizes, self.bucket_bytes)) != 1:
            raise ValueError(
                f"a bucket of {sum(sizes)} B in {len(sizes)} tensors is not one vLLM packed "
                f"chunk (cap {self.bucket_bytes} B): the transport would broadcast it whole"
            )
        meta = {"names": list(names), "dtype_names": dtype_names, "shapes": shapes}
        same = meta == self._meta
        empty: dict[str, list[Any]] = {"names": [], "dtype_names": [], "shapes": []}
        self._meta = None  # unknown until this call succeeded
        try:
            await self._call("POST", "/update_weights", {"update_info": empty if same else meta})
        except EngineError as exc:
            if exc.answered:  # vLLM's own answer: the failed update ended it (gw:1616-1631)
                self._open = False
            raise
        self._meta = meta

    async def end_weight_update(self, version: str | None = None) -> bool:
        """``/finish_weight_update`` with the session's version (module docstring); nothing
        when the session is known to be over (a failed update ended it: its finish would
        fail, gw:1638-1641)."""
        if self._open is False:
            return False
        body = {"weight_version": str(version)} if version is not None else None
        self._open = False
        await self._call("POST", "/finish_weight_update", body)
        self._finished = str(version) if version is not None else None
        return True

    async def update_weight_version(self, new_version: str) -> None:
        """The version is the finish's: done when the session's finish set ``new_version``;
        otherwise that finish failed (or none ran) and the weights are not that version:
        EngineError (the push fails and is re-sent as a new round)."""
        if self._finished != str(new_version):
            raise EngineError(
                "/finish_weight_update", 409, f"no finished update set v{new_version}"
            )

    async def weight_checksums(self) -> dict[str, str]:
        """Every worker's sha256 per loaded tensor (``/weight_checker``, module docstring)."""
        out = await self._call("POST", "/weight_checker", {"action": "checksum"})
        if not isinstance(out, dict) or not isinstance(out.get("checksums"), dict):
            raise EngineError("/weight_checker", 200, f"unexpected response: {out!r:.200}")
        return {str(k): str(v) for k, v in out["checksums"].items()}
