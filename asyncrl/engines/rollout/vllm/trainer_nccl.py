"""Trainer rank 0 of a vLLM 0.33 NCCL weight group, through vLLM's own trainer-side code.

Runs in the trainer process (the collective transport calls :func:`join_vllm_nccl` through
the family's ``VLLMWeights.trainer_link``), with ``rollout.backend = "vllm"`` and
``weights.backend = "nccl"`` (or ``auto`` on a CUDA trainer) only.

Why vLLM's code and not torch's NCCL group: vLLM's workers join with
``worker_init_process_group`` (``nc`` = ``vllm/distributed/weight_transfer/nccl_common.py``:
262-291): a ``StatelessProcessGroup`` on a TCP store that rank 0 hosts
(``vllm/distributed/utils.py:537-581``), then a ``PyNcclCommunicator`` whose rank 0 mints
the NCCL unique id and writes it, pickled, under the store key ``broadcast_from/0/0``
(``device_communicators/pynccl.py:144-162``, ``utils.py:323-339``), followed by a one-element
warm-up ``all_reduce`` (pynccl.py:184-191). torch's ``ProcessGroupNCCL`` exchanges its id under
other keys and issues no such warm-up: the two never meet. So the trainer calls vLLM's
``trainer_init`` (nc:294-332: that store and communicator, rank 0, on the current CUDA
device), concurrently with the engines' ``/init_weight_transfer_engine`` calls, as vLLM's
``run_trainer_rendezvous`` does (nc:150-158); our transport already runs the two at once.

The data path: each bucket (asyncrl's staged bytes, which are exactly one vLLM packed chunk:
``vllm/control.py``) is broadcast with the communicator's ``broadcast(tensor, src=0,
stream)`` (pynccl.py:543-567), the call vLLM's ``packed_nccl_broadcast_producer`` makes per
chunk (``packed_tensor.py:146-193``), on a stream of its own ordered after the stream that
staged the bucket. The producer itself is not used: it packs its own chunks (a ``torch.cat``
per chunk) from full tensors and sends a whole push in one synchronous call, while asyncrl
stages buckets double-buffered while the previous one is on the wire and announces each with
its own ``/update_weights`` call (one call's tensors = one chunk on the receiving side,
packed_tensor.py:259-284); the bytes on the wire are the same.

A ``PyNcclCommunicator`` that cannot load NCCL (or under ``VLLM_DISABLE_PYNCCL``) disables
itself and its ``broadcast`` returns doing nothing (pynccl.py:125-137, 544-545): refused here,
naming why, instead of pushing nothing. vLLM is imported only here, only then: it is the
optional extra ``asyncrl[vllm-trainer]`` (``vllm==0.33.0``, which pins its own torch).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from asyncrl.engines.rollout.vllm import TRAINER_MISSING

__all__ = ["PyNcclLink", "join_vllm_nccl", "vllm_nccl_common"]


def vllm_nccl_common() -> ModuleType:
    """vLLM's ``nccl_common`` module; ValueError naming the extra when vLLM does not import."""
    try:
        from vllm.distributed.weight_transfer import nccl_common
    except ImportError as exc:
        raise ValueError(f"{TRAINER_MISSING} ({type(exc).__name__}: {exc})") from exc
    return nccl_common


class PyNcclLink:
    """A :class:`~asyncrl.engines.rollout.base.TrainerLink` over vLLM's ``PyNcclCommunicator``
    (rank 0): each bucket broadcast on the link's own CUDA stream (module docstring)."""

    def __init__(self, comm: Any) -> None:
        if getattr(comm, "disabled", True) or not getattr(comm, "available", False):
            raise RuntimeError(
                "vLLM's PyNcclCommunicator disabled itself (NCCL library not loadable, or "
                "VLLM_DISABLE_PYNCCL set; vllm/distributed/device_communicators/pynccl.py:"
                "125-137): its broadcasts would send nothing"
            )
        self.comm = comm
        self.device: torch.device = comm.device
        self.stream = torch.cuda.Stream(device=self.device)

    def post(self, tensor: torch.Tensor) -> torch.cuda.Event:
        if tensor.device != self.device:
            raise ValueError(
                f"bucket on {tensor.device}, but the vLLM weight group's communicator is on "
                f"{self.device} (weights are staged on the trainer's device)"
            )
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the staged bytes
        self.comm.broadcast(tensor, src=0, stream=self.stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        return done

    def finish(self, work: torch.cuda.Event, tensor: torch.Tensor) -> None:
        work.synchronize()

    def close(self) -> None:
        self.comm.destroy()  # ncclCommAbort in a thread it joins for 5 s (pynccl.py:250-271)


def join_vllm_nccl(master_address: str, master_port: int, world_size: int, device: str) -> Any:
    """Rank 0 of the vLLM weight group of ``world_size`` ranks at ``master_address:
    master_port`` on ``device`` (the trainer's CUDA device, where buckets are staged): vLLM's
    ``trainer_init`` (nc:294-332). Blocks until every engine rank joined; ranks that never
    come leave it blocked in ``ncclCommInitRank`` (the engines' failed join calls fail the
    transport's form, naming them)."""
    nccl_common = vllm_nccl_common()
    if not torch.cuda.is_available():
        raise ValueError("weights.backend='nccl' with rollout.backend='vllm' needs a CUDA trainer")
    info = {"master_address": master_address, "master_port": master_port, "world_size": world_size}
    with torch.cuda.device(torch.device(device)):  # trainer_init takes the current device
        comm = nccl_common.trainer_init(info)
    return PyNcclLink(comm)
