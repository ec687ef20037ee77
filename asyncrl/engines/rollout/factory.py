"""The one place an engine family is chosen: from the tagged ``RolloutConfig``.

:func:`make_engine` builds what the controller holds of an engine (the RolloutEngine
seam); :func:`weight_family` what the weight transport needs (the EngineControl seam:
a :class:`~asyncrl.engines.rollout.base.WeightFamily` whose ``make`` builds each engine's
control). No other code compares backend names.
"""

from __future__ import annotations

from typing import Any

import msgspec

from asyncrl.config import (
    LocalRolloutConfig,
    RolloutConfig,
    SGLangRolloutConfig,
    VLLMRolloutConfig,
)
from asyncrl.engines.rollout.base import (
    AdapterControl,
    ControlledEngine,
    ManagedEngine,
    TrainerLink,
    WeightFamily,
)

__all__ = ["make_engine", "rollout_config", "weight_family"]


def rollout_config(rollout: RolloutConfig | str) -> RolloutConfig:
    """``rollout`` itself, or the default config of the backend tag ``rollout`` names."""
    if isinstance(rollout, str):
        return msgspec.convert({"backend": rollout}, RolloutConfig)
    return rollout


def make_engine(rollout: RolloutConfig, url: str) -> ManagedEngine:
    """The client of the engine at ``url`` with the run's request timeout."""
    if isinstance(rollout, VLLMRolloutConfig):
        from asyncrl.engines.rollout.vllm.client import VLLMClient

        return VLLMClient(url, rollout.request_timeout_s, rollout.retry_503_s)
    from asyncrl.engines.rollout.sglang.client import SGLangClient

    return SGLangClient(url, timeout_s=rollout.request_timeout_s)


def weight_family(rollout: RolloutConfig | str, bucket_bytes: int = 1 << 30) -> WeightFamily:
    """What the weight transport needs of ``rollout``'s engine family (``bucket_bytes``: the
    transport's bucket size, which vLLM's packed chunks are cut at)."""
    rc = rollout_config(rollout)
    if isinstance(rc, VLLMRolloutConfig):
        from asyncrl.engines.rollout.vllm.client import VLLMClient
        from asyncrl.engines.rollout.vllm.control import VLLMControl
        from asyncrl.engines.rollout.vllm.layout import VLLMDigests

        def make_vllm(url: str, timeout_s: float) -> ControlledEngine:
            return VLLMControl(url, timeout_s, bucket_bytes, retry_503_s=rc.retry_503_s)

        def vllm_adapters(url: str, timeout_s: float) -> AdapterControl:
            return VLLMClient(url, timeout_s, retry_503_s=rc.retry_503_s)

        async def vllm_digests(engine: ControlledEngine) -> dict[str, str]:
            assert isinstance(engine, VLLMControl)
            return await engine.weight_checksums()  # /weight_checker {"action": "checksum"}

        return WeightFamily(
            "vLLM",
            make_vllm,
            loads_live=True,
            check=_vllm_check,
            received=lambda e: False,
            adapters=vllm_adapters,  # /v1/load_lora_adapter from a folder
            digests=vllm_digests,
            compare_digests=VLLMDigests(),  # fused, padded, sharded, cast as vLLM loads them
            nccl_group=_vllm_nccl_group,  # vLLM's own trainer_init (PyNcclCommunicator)
            adapter_folders_kept=True,
        )
    from asyncrl.engines.rollout.sglang.client import SGLangClient

    def make_sglang(url: str, timeout_s: float) -> ControlledEngine:
        return SGLangClient(url, timeout_s=timeout_s)

    if isinstance(rc, SGLangRolloutConfig):
        from asyncrl.engines.rollout.sglang.control import sglang_check, sglang_received
        from asyncrl.transports.weights import CUDA_IPC_SGLANG

        return WeightFamily(
            "SGLang",
            make_sglang,
            loads_live=True,
            no_ipc=CUDA_IPC_SGLANG,
            check=sglang_check,
            received=sglang_received,
            adapters=SGLangClient,  # /load_lora_adapter from a folder (0.5.10 .. 0.5.23)
        )
    assert isinstance(rc, LocalRolloutConfig)
    return WeightFamily("embedded engine", make_sglang, ipc=True)


def _vllm_nccl_group(address: str, port: int, world_size: int, device: str) -> TrainerLink:
    """Rank 0 of a vLLM NCCL weight group, with vLLM's trainer-side code (imported only now:
    the optional extra ``asyncrl[vllm-trainer]``; see ``vllm/trainer_nccl.py``)."""
    from asyncrl.engines.rollout.vllm.trainer_nccl import join_vllm_nccl

    return join_vllm_nccl(address, port, world_size, device)


def _vllm_check(infos: list[dict[str, Any]], pause_mode: str) -> bool:
    """vLLM takes every pause mode it names; nothing to flush (no ``flush_cache``)."""
    return False
