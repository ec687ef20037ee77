"""Weight sync from the trainer into the rollout engines (see ``base`` for the contract)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from asyncrl.config import CudaIpcWeightsConfig, WeightSyncConfig

if TYPE_CHECKING:
    from asyncrl.transports.weights.base import WeightTransport

__all__ = ["CUDA_IPC_SGLANG", "make_weight_transport"]

CUDA_IPC_SGLANG = (
    "weights.backend='cuda-ipc' works with the embedded engine only: asyncrl's CUDA IPC push "
    "sends a JSON descriptor (load_format='asyncrl_ipc'), which SGLang's scheduler does not "
    "know and dies on (NotImplementedError 'Unknown load_format', sglang 0.5.23 "
    "model_runner_components/weight_updater.py:372-380); use weights.backend='nccl' with "
    "rollout.backend='sglang'"
)


def make_weight_transport(
    cfg: WeightSyncConfig,
    engine_urls: Sequence[str],
    device: str,
    pause_mode: str = "abort",
    engine: str = "local",
) -> WeightTransport:
    """The one factory of weight transports: the backend is chosen here, once.

    ``cuda-ipc``: colocated engines on the trainer's GPU(s); ``gloo``/``nccl``/``hccl``: a
    dedicated collective group; ``auto``: nccl on CUDA, hccl on an Ascend NPU, else gloo.
    Raises ValueError naming what to install when the backend is not available here.
    ``engine``: ``local`` (the embedded engine: staged, verified, all-or-nothing) or
    ``sglang`` (see ``collective_send``: whole tensors, paused transfer, re-push on failure).
    """
    if isinstance(cfg, CudaIpcWeightsConfig):
        if engine == "sglang":
            raise ValueError(CUDA_IPC_SGLANG)
        from asyncrl.transports.weights.cuda_ipc_send import CudaIpcWeightSender

        return CudaIpcWeightSender(engine_urls, cfg, pause_mode=pause_mode, device=device)
    from asyncrl.transports.weights.collective_send import CollectiveWeightSender, resolve_backend

    backend = resolve_backend(cfg.backend, device)
    return CollectiveWeightSender(
        engine_urls, cfg, backend, pause_mode=pause_mode, device=device, engine=engine
    )
