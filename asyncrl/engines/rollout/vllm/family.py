"""The vLLM engine family: its registry entry (:data:`FAMILY`) and its side of weight sync
(:class:`VLLMWeights`). Imports nothing heavy at module level (the controller loads it to
launch engines, the trainer to push weights)."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from asyncrl.config import (
    AutoWeightsConfig,
    LoraConfig,
    NcclWeightsConfig,
    RolloutConfig,
    RunConfig,
    VLLMRolloutConfig,
)
from asyncrl.engines.rollout.base import (
    AdapterControl,
    DigestCompare,
    EngineError,
    ManagedEngine,
    TrainerLink,
    WeightEngine,
)
from asyncrl.engines.rollout.sglang.family import model_startup_s, package_missing

if TYPE_CHECKING:
    from asyncrl.engines.rollout.launcher import LaunchSpec, ServerSite
    from asyncrl.transports.weights.bucket import BucketManifest

__all__ = ["FAMILY", "VLLMFamily", "VLLMWeights"]

NO_IPC = (
    "weights.backend='cuda-ipc' works with the embedded engine only (rollout.backend='local'); "
    "use weights.backend='nccl' (or 'auto', 'gloo') with other engines"
)


class VLLMWeights:
    """vLLM 0.33's side of weight sync (a :class:`~asyncrl.transports.weights.seam.WeightAdapter`).

    Load format: one ``/update_weights`` call per bucket with names, dtypes and shapes only
    (vLLM refuses fields it does not know), each bucket exactly one of vLLM's packed chunks
    (``packed_buffer_size_bytes`` = the transport's bucket size, ``vllm/control.py``); the
    version set by the session's finish. vLLM loads live, takes every pause mode it names,
    has nothing to flush; an error answer means its workers stopped receiving
    (gpu_worker.py:1616-1631). Digests: ``/weight_checker``, compared as vLLM fuses, pads,
    shards and casts (``vllm/layout.py``). NCCL: vLLM's own trainer-side group
    (``vllm/trainer_nccl.py``). LoRA: ``/v1/load_lora_adapter`` from folders kept while
    newer versions load.
    """

    name = "vLLM"
    loads_live = True
    no_ipc = NO_IPC
    adapter_folders_kept = True

    def __init__(self, rc: VLLMRolloutConfig, bucket_bytes: int):
        self.retry_503_s = rc.retry_503_s
        self.bucket_bytes = bucket_bytes
        from asyncrl.engines.rollout.vllm.layout import VLLMDigests

        self.compare_digests: DigestCompare | None = VLLMDigests()

    @property
    def adapters(self) -> Callable[[str, float], AdapterControl] | None:
        from asyncrl.engines.rollout.vllm.client import VLLMClient

        retry = self.retry_503_s

        def make(url: str, timeout_s: float) -> AdapterControl:
            return VLLMClient(url, timeout_s, retry_503_s=retry)

        return make

    def engine(self, url: str, timeout_s: float) -> WeightEngine:
        from asyncrl.engines.rollout.vllm.control import VLLMControl

        return VLLMControl(url, timeout_s, self.bucket_bytes, retry_503_s=self.retry_503_s)

    def check(self, infos: list[dict[str, Any]], pause_mode: str) -> bool:
        return False  # every pause mode is vLLM's own; no flush_cache

    def announce(
        self, engine: WeightEngine, m: BucketManifest, group_name: str, flush: bool
    ) -> Coroutine[Any, Any, None]:
        return engine.update_weights_from_distributed(m.announcement(group_name))

    def received(self, exc: EngineError) -> bool:
        return exc.status == 200

    def trainer_link(
        self, backend: str, address: str, port: int, world: int, device: str
    ) -> TrainerLink | None:
        """NCCL: rank 0 of vLLM's group with vLLM's own trainer-side code (imported only now:
        the optional extra ``asyncrl[vllm-trainer]``); other backends: torch's group."""
        if backend != "nccl":
            return None
        from asyncrl.engines.rollout.vllm.trainer_nccl import join_vllm_nccl

        return join_vllm_nccl(address, port, world, device)

    def digests(self, engine: WeightEngine) -> Awaitable[dict[str, str]]:
        from asyncrl.engines.rollout.vllm.control import VLLMControl

        assert isinstance(engine, VLLMControl)
        return engine.weight_checksums()  # /weight_checker {"action": "checksum"}


class VLLMFamily:
    """vLLM servers (``vllm serve``), spoken to over vLLM 0.33's RL API."""

    name = "vLLM"
    preload: tuple[str, ...] = ()
    derives_context = False

    def client(self, rc: RolloutConfig, url: str) -> ManagedEngine:
        from asyncrl.engines.rollout.vllm.client import VLLMClient

        assert isinstance(rc, VLLMRolloutConfig)
        return VLLMClient(url, rc.request_timeout_s, rc.retry_503_s)

    def weights(self, rc: RolloutConfig, bucket_bytes: int) -> VLLMWeights:
        assert isinstance(rc, VLLMRolloutConfig)
        return VLLMWeights(rc, bucket_bytes)

    def spec(self, rc: RolloutConfig, at: ServerSite) -> LaunchSpec:
        from asyncrl.engines.rollout.vllm.launcher import vllm_spec

        assert isinstance(rc, VLLMRolloutConfig)
        return vllm_spec(rc, at)

    def startup_timeout(self, rc: RolloutConfig, model_path: str) -> float:
        return model_startup_s(model_path)

    def lora_args(self, lc: LoraConfig, capacity: int) -> tuple[str, ...]:
        from asyncrl.engines.rollout.vllm.launcher import vllm_lora_args

        return vllm_lora_args(lc, capacity)

    def gpus(self, rc: RolloutConfig) -> int:
        assert isinstance(rc, VLLMRolloutConfig)
        return rc.tp_size

    def preflight(self, cfg: RunConfig, check_device: Callable[[str, str], None]) -> None:
        """vLLM installed where it starts servers; vLLM engines over NCCL (``nccl``, or
        ``auto`` on a CUDA trainer) need vLLM's trainer-side code in the trainer's
        environment (``vllm/trainer_nccl.py``): refused now, naming the extra, rather than
        when the trainer forms the group."""
        package_missing(cfg.rollout, "vllm", "pip install 'asyncrl[vllm-trainer]' (vllm==0.33.0)")
        weights = cfg.weights
        nccl = isinstance(weights, NcclWeightsConfig) or (
            isinstance(weights, AutoWeightsConfig) and cfg.trainer.device.startswith("cuda")
        )
        if not nccl:
            return
        try:  # installed (its metadata; importing vLLM would load torch into the controller)
            importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            from asyncrl.engines.rollout.vllm import TRAINER_MISSING

            raise ValueError(TRAINER_MISSING) from None


FAMILY = VLLMFamily()
