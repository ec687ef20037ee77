"""Trainer rank 0 of a vLLM weight group formed the way ``trainer_init`` forms it, against the
stand-in (run as ``python -m tests.engines.rollout.vllm.trainer_side URL MODEL_DIR`` with
vLLM's source on ``PYTHONPATH``: ``code.vllm_env``; it prints one JSON line).

asyncrl's collective sender with ``weights.backend = "nccl"`` and the vLLM family joins
through the family's ``trainer_link`` (in production vLLM's ``trainer_init``,
``engines/rollout/vllm/trainer_nccl.py``). ``trainer_init`` does two things (vLLM 0.33
``distributed/weight_transfer/nccl_common.py:294-332`` -> ``:194-214``): vLLM's own
``StatelessProcessGroup.create`` as rank 0, which hosts the TCP store the workers join
(``distributed/utils.py:537-581``), then a ``PyNcclCommunicator`` on it. The first is run
here unchanged; NCCL cannot run on a CPU (``trainer_init`` itself refuses: it asks
``torch.accelerator`` for the current device), so the second is a Gloo group on that very
store, the mirror of the stand-in's receiving ranks (``rank.py``). What this shows: the
sender takes the family's join for NCCL, runs it concurrently with the engines'
``/init_weight_transfer_engine`` (the stand-in answers only once its ranks joined the store
rank 0 hosts: run in turn, the two would wait on each other), with vLLM's rank layout, and
every bucket posted through the returned link arrives bit-exact.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from asyncrl.config import GlooWeightsConfig, VLLMRolloutConfig
from asyncrl.engines.rollout.base import TrainerLink
from asyncrl.engines.rollout.vllm.family import VLLMWeights
from asyncrl.transports.weights.collective_send import CollectiveWeightSender
from asyncrl.transports.weights.collective_wire import TorchLink, group_on_store
from tests.engines.rollout.vllm.rank import GROUP

JOINS: list[dict[str, object]] = []


def join(address: str, port: int, world_size: int, device: str) -> TrainerLink:
    """vLLM's rank-0 rendezvous (``StatelessProcessGroup.create``, as nccl_common.py:210-212
    calls it), then Gloo on its store in place of ``PyNcclCommunicator`` (module docstring)."""
    from vllm.distributed.utils import StatelessProcessGroup

    spg = StatelessProcessGroup.create(host=address, port=port, rank=0, world_size=world_size)
    JOINS.append({"address": address, "world_size": world_size, "device": device})
    return TorchLink(group_on_store("gloo", spg.store, 0, world_size, GROUP, 120.0))


class JoinedHere(VLLMWeights):
    """The vLLM family, its NCCL join replaced by :func:`join` (module docstring)."""

    def trainer_link(
        self, backend: str, address: str, port: int, world: int, device: str
    ) -> TrainerLink | None:
        assert backend == "nccl"
        return join(address, port, world, device)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def main() -> None:
    from safetensors.torch import load_file

    url, model_dir = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    cfg = GlooWeightsConfig(bucket_mb=1, timeout_s=60)
    family = JoinedHere(VLLMRolloutConfig(), cfg.bucket_mb << 20)
    sender = CollectiveWeightSender([url], cfg, "nccl", family, "keep", "cpu")
    weights = load_file(str(model_dir / "model.safetensors"))
    try:
        sender.connect()
        for v in (1, 2):
            sender.push(((n, w + v) for n, w in weights.items()), v).wait(120)
    finally:
        sender.close()
    want = {n: _sha(w + 2) for n, w in weights.items()}
    print(json.dumps({"joins": JOINS, "want": want}), flush=True)


if __name__ == "__main__":
    main()
