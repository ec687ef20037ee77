"""Weight sync from the trainer into the rollout engines (see ``base`` for the contract).

The transports move bytes and know no engine: the engines' family comes in as a
:class:`~asyncrl.transports.weights.seam.WeightAdapter` (built by the engine families'
registry, ``engines/rollout/factory.py``, whose ``make_weight_transport`` calls
:func:`make_sender`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from asyncrl.config import CudaIpcWeightsConfig, WeightSyncConfig

if TYPE_CHECKING:
    from asyncrl.transports.weights.adapter_send import AdapterSpec
    from asyncrl.transports.weights.base import WeightTransport
    from asyncrl.transports.weights.seam import WeightAdapter

__all__ = ["make_sender"]


def make_sender(
    cfg: WeightSyncConfig,
    engine_urls: Sequence[str],
    device: str,
    family: WeightAdapter,
    pause_mode: str = "abort",
    adapters: AdapterSpec | None = None,
) -> WeightTransport:
    """The one factory of weight transports: the backend is chosen here, once.

    ``cuda-ipc``: colocated engines on the trainer's GPU(s); ``gloo``/``nccl``/``hccl``: a
    dedicated collective group; ``auto``: nccl on CUDA, hccl on an Ascend NPU, else gloo.
    Raises ValueError naming what to install when the backend is not available here, or
    why ``family`` cannot take it. ``adapters`` (a LoRA run): a family that loads adapters
    from a folder (SGLang, vLLM) gets the
    :class:`~asyncrl.transports.weights.adapter_send.AdapterFolderSender`; others take them
    over the collective transport.
    """
    if adapters is not None and family.adapters is not None:
        from asyncrl.transports.weights.adapter_send import AdapterFolderSender

        return AdapterFolderSender(
            engine_urls, adapters, family.adapters, cfg.timeout_s, family.adapter_folders_kept
        )
    if isinstance(cfg, CudaIpcWeightsConfig):
        if family.no_ipc:
            raise ValueError(family.no_ipc)
        from asyncrl.transports.weights.cuda_ipc_send import CudaIpcWeightSender

        return CudaIpcWeightSender(engine_urls, cfg, family, pause_mode=pause_mode, device=device)
    from asyncrl.transports.weights.collective_send import CollectiveWeightSender, resolve_backend

    backend = resolve_backend(cfg.backend, device)
    return CollectiveWeightSender(
        engine_urls, cfg, backend, family, pause_mode=pause_mode, device=device
    )
