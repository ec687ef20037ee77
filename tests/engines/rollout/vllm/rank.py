"""One receiving worker rank of a vLLM 0.33 engine, for the stand-in (``standin.py``).

Run as ``python -m tests.engines.rollout.vllm.rank`` with vLLM's source on ``PYTHONPATH``
(``code.vllm_env``). One JSON command per stdin line, one JSON answer per stdout line (with
``--connect PATH``: per line of a unix socket it connects to, as when forked):

- ``init`` {master_address, master_port, rank_offset, world_size, tp_rank}: joins as rank
  ``rank_offset + dp·TP·PP + rank`` (vllm/distributed/weight_transfer/nccl_common.py:
  239-244; dp 0, PP 1 here) through vLLM's own ``StatelessProcessGroup.create`` (the TCP
  store rank 0 hosts, vllm/distributed/utils.py:537-581, as nccl_common.py:194-214 does).
  NCCL cannot run on a CPU: the data plane is a Gloo group built on that very store
  (asyncrl's ``collective_wire.group_on_store``) in place of vLLM's ``PyNcclCommunicator``.
- ``recv`` {names, dtype_names, shapes, cap, load}: what one ``/update_weights`` call
  receives with ``packed=True`` (nccl_engine.py:211-228): the tensors cut into chunks by
  vLLM's rule — a chunk closes after the tensor that takes it over ``cap``
  (``packed_buffer_size_bytes``) or at the last one (packed_tensor.py:259-284) — one uint8
  broadcast per chunk from rank 0, rebuilt with vLLM's own ``unpack_tensor``
  (packed_tensor.py:27-55). ``load``: kept by name (the live model, layerwise reload);
  False: received, then the load fails (the stand-in's injected failure). ``corrupt_rank``
  equal to this rank's: the call's last tensor loaded one off in its first element, answered as
  loaded (a silent fault for ``/weight_checker`` to find; vLLM has no such switch).
- ``checksums``: sha256 of every loaded tensor's bytes by Hugging Face name (the ground
  truth); ``held``: what ``/weight_checker`` answers (model_loader/weight_checksum.py:32-38):
  the sha256 of vLLM's parameters on this rank, fused, padded, sharded and cast as vLLM's
  loader makes them (``model_layout.py``); ``destroy``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import socket
import sys
import traceback
from typing import Any

import torch

from asyncrl.config import GlooWeightsConfig
from asyncrl.transports.weights.collective_wire import (
    broadcast,
    destroy_weight_group,
    group_on_store,
)
from tests.engines.rollout.vllm.code import packed_tensor
from tests.engines.rollout.vllm.model_layout import VLLMQwen2, served_dtype
from tests.session_forks import as_imported

GROUP = GlooWeightsConfig().group_name
"""The Gloo group's store prefix: asyncrl's default ``weights.group_name`` (vLLM's init info
has no group name; its PyNccl group uses the store's keys directly)."""


class Rank:
    def __init__(self) -> None:
        from vllm.distributed.utils import StatelessProcessGroup

        self.spg_cls = StatelessProcessGroup
        self.unpack = packed_tensor().unpack_tensor
        self.group: Any = None
        self.spg: Any = None
        self.loaded: dict[str, torch.Tensor] = {}

    def init(self, c: dict[str, Any]) -> dict[str, Any]:
        rank = int(c["rank_offset"]) + int(c["tp_rank"])
        world = int(c["world_size"])
        self.spg = self.spg_cls.create(
            host=c["master_address"], port=int(c["master_port"]), rank=rank, world_size=world
        )
        self.group = group_on_store("gloo", self.spg.store, rank, world, GROUP, 120.0)
        return {"rank": rank}

    def recv(self, c: dict[str, Any]) -> dict[str, Any]:
        names, shapes = c["names"], c["shapes"]
        dtypes = [getattr(torch, d) for d in c["dtype_names"]]
        sizes = [math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True)]
        got: list[tuple[str, torch.Tensor]] = []
        start, total, chunks = 0, 0, 0
        for i, size in enumerate(sizes):
            total += size
            if total > int(c["cap"]) or i == len(sizes) - 1:
                packed = torch.empty(total, dtype=torch.uint8)
                broadcast(self.group, packed, 0)
                end = i + 1
                part = self.unpack(
                    packed, names[start:end], shapes[start:end], dtypes[start:end],
                    sizes[start:end],
                )  # fmt: skip
                got += [(n, t.clone()) for n, t in part]
                start, total, chunks = end, 0, chunks + 1
        if got and c.get("corrupt_rank", -1) == c["tp_rank"]:  # the stand-in's silent fault
            got[-1][1].view(-1)[0] += 1  # the last: a norm, whole on every rank
        if c.get("load", True):
            self.loaded.update(got)
        truth = c.get("truth", True)  # False (a benchmark's stand-in): names only, no hashing
        return {"chunks": chunks, "sha256": {n: _sha(t) if truth else "" for n, t in got}}

    def checksums(self, c: dict[str, Any]) -> dict[str, Any]:
        return {"sha256": {n: _sha(t) for n, t in sorted(self.loaded.items())}}

    def held(self, c: dict[str, Any]) -> dict[str, Any]:
        """What vLLM's ``/weight_checker`` hashes on this rank: the checkpoint and every tensor
        loaded since, in vLLM's parameters ({model_path, tp_size, dtype}; model_layout.py)."""
        from safetensors.torch import load_file

        path = c["model_path"]
        model = VLLMQwen2(path, c["tp_rank"], c["tp_size"], served_dtype(path, c["dtype"]))
        for n, t in {**load_file(f"{path}/model.safetensors"), **self.loaded}.items():
            model.load(n, t)
        return {"sha256": model.digests()}

    def destroy(self, c: dict[str, Any]) -> dict[str, Any]:
        destroy_weight_group(self.group)
        self.group, self.spg = None, None
        return {}


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def main() -> None:
    """JSON lines over stdin/stdout, or over the unix socket of ``--connect PATH``
    (``standin_proc.RankProc``)."""
    p = argparse.ArgumentParser()
    p.add_argument("--connect", default="", help="a unix socket to talk over")
    args = p.parse_args()
    torch.set_num_threads(1)
    as_imported()  # forked from the session's vLLM fork server: what vLLM's imports set
    rx, tx = sys.stdin, sys.stdout
    if args.connect:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(args.connect)
        rx, tx = sock.makefile("r"), sock.makefile("w")
    rank = Rank()
    print(json.dumps({"ready": True}), file=tx, flush=True)
    for line in rx:
        c = json.loads(line)
        try:
            out = {"ok": True, **getattr(rank, c.pop("op"))(c)}
        except Exception as exc:  # answered, named: the stand-in turns it into vLLM's error
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc(file=sys.stderr)
        print(json.dumps(out), file=tx, flush=True)


if __name__ == "__main__":
    main()
