"""Weight sync from the trainer into the rollout engines (see ``base`` for the contract)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from asyncrl.config import WeightSyncConfig

if TYPE_CHECKING:
    from asyncrl.transports.weights.base import WeightTransport

__all__ = ["make_weight_transport"]


def make_weight_transport(
    cfg: WeightSyncConfig, engine_urls: Sequence[str], device: str, pause_mode: str = "abort"
) -> WeightTransport:
    """The one factory of weight transports: chooses from ``cfg.backend`` and the device."""
    if cfg.backend == "cuda-ipc":
        raise ValueError("weights.backend='cuda-ipc' is not available yet (use gloo or nccl)")
    from asyncrl.transports.weights.collective import CollectiveWeightSender, resolve_backend

    backend = resolve_backend(cfg.backend, device)
    return CollectiveWeightSender(engine_urls, cfg, backend, pause_mode=pause_mode, device=device)
