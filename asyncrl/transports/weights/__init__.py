"""Weight sync from the trainer into the rollout engines (see ``base`` for the contract)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from asyncrl.config import CudaIpcWeightsConfig, RolloutConfig, WeightSyncConfig

if TYPE_CHECKING:
    from asyncrl.transports.weights.adapter_send import AdapterSpec
    from asyncrl.transports.weights.base import WeightTransport

__all__ = ["CUDA_IPC_OTHER", "CUDA_IPC_SGLANG", "make_weight_transport"]

CUDA_IPC_SGLANG = (
    "weights.backend='cuda-ipc' works with the embedded engine only: asyncrl's CUDA IPC push "
    "sends a JSON descriptor (load_format='asyncrl_ipc'), which SGLang's scheduler does not "
    "know and dies on (NotImplementedError 'Unknown load_format', sglang 0.5.23 "
    "model_runner_components/weight_updater.py:372-380); use weights.backend='nccl' with "
    "rollout.backend='sglang'"
)
CUDA_IPC_OTHER = (
    "weights.backend='cuda-ipc' works with the embedded engine only (rollout.backend='local'); "
    "use weights.backend='nccl' (or 'auto', 'gloo') with other engines"
)


def make_weight_transport(
    cfg: WeightSyncConfig,
    engine_urls: Sequence[str],
    device: str,
    pause_mode: str = "abort",
    engine: RolloutConfig | str = "local",
    adapters: AdapterSpec | None = None,
) -> WeightTransport:
    """The one factory of weight transports: the backend is chosen here, once.

    ``cuda-ipc``: colocated engines on the trainer's GPU(s); ``gloo``/``nccl``/``hccl``: a
    dedicated collective group; ``auto``: nccl on CUDA, hccl on an Ascend NPU, else gloo.
    Raises ValueError naming what to install when the backend is not available here.
    ``engine``: the run's ``RolloutConfig`` (or its backend tag), whose engine family the
    engine-control factory (:func:`asyncrl.engines.rollout.factory.weight_family`) gives
    the transport: the embedded engine (staged, verified, all-or-nothing), SGLang or vLLM
    (see ``collective_send``: whole tensors, paused transfer, re-push on failure).
    ``adapters`` (a LoRA run): a family that loads adapters from a folder (SGLang) gets the
    :class:`~asyncrl.transports.weights.adapter_send.AdapterFolderSender`; the embedded
    engine takes them over the collective transport.
    """
    from asyncrl.engines.rollout.factory import weight_family

    bucket_bytes = getattr(cfg, "bucket_mb", 1024) << 20
    family = weight_family(engine, bucket_bytes)
    if adapters is not None and family.adapters is not None:
        from asyncrl.transports.weights.adapter_send import AdapterFolderSender

        return AdapterFolderSender(
            engine_urls, adapters, family.adapters, cfg.timeout_s, family.adapter_folders_kept
        )
    if isinstance(cfg, CudaIpcWeightsConfig):
        if not family.ipc:
            raise ValueError(family.no_ipc or CUDA_IPC_OTHER)
        from asyncrl.transports.weights.cuda_ipc_send import CudaIpcWeightSender

        return CudaIpcWeightSender(engine_urls, cfg, pause_mode=pause_mode, device=device)
    from asyncrl.transports.weights.collective_send import CollectiveWeightSender, resolve_backend

    backend = resolve_backend(cfg.backend, device)
    return CollectiveWeightSender(
        engine_urls, cfg, backend, pause_mode=pause_mode, device=device, family=family
    )
