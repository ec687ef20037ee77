"""The SGLang engine family: its registry entry (:data:`FAMILY`) and its side of weight sync
(:class:`SGLangWeights`, which the embedded engine, speaking SGLang's protocol, extends).

Nothing here is imported at module level beyond the config and the seams: the controller
loads this module to launch engines, the trainer to push weights into them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from asyncrl.config import LoraConfig, RolloutConfig, RunConfig, SGLangRolloutConfig
from asyncrl.engines.rollout.base import (
    AdapterControl,
    DigestCompare,
    EngineError,
    ManagedEngine,
    TrainerLink,
    WeightEngine,
)
from asyncrl.transports.weights.base import WeightSyncError

if TYPE_CHECKING:
    from asyncrl.engines.rollout.launcher import LaunchSpec, ServerSite
    from asyncrl.transports.weights.bucket import BucketManifest

__all__ = ["CUDA_IPC_SGLANG", "FAMILY", "SGLangFamily", "SGLangWeights", "model_startup_s"]

CUDA_IPC_SGLANG = (
    "weights.backend='cuda-ipc' works with the embedded engine only: asyncrl's CUDA IPC push "
    "sends a JSON descriptor (load_format='asyncrl_ipc'), which SGLang's scheduler does not "
    "know and dies on (NotImplementedError 'Unknown load_format', sglang 0.5.23 "
    "model_runner_components/weight_updater.py:372-380); use weights.backend='nccl' with "
    "rollout.backend='sglang'"
)


class SGLangWeights:
    """SGLang's side of weight sync (a :class:`~asyncrl.transports.weights.seam.WeightAdapter`).

    Load format: each bucket announced by ``/update_weights_from_distributed`` with
    ``load_format="flattened_bucket"`` (SGLang's FlattenedTensorBucket: the tensors' bytes
    back to back, one broadcast) plus an ``asyncrl_bucket`` field (index, count, version,
    checksum, chunks) that SGLang ignores and the embedded engine reads; ``weight_version``
    on the last bucket (SGLang relabels with the load, scheduler_components/
    weight_updater.py:224) and ``flush_cache`` there when :meth:`check` allows it. SGLang
    loads live (whole tensors only), answers 400 with its JSON body also after receiving
    (:meth:`received`), loads LoRA adapters from folders, and takes no CUDA IPC hand-off.
    """

    name = "SGLang"
    loads_live = True
    no_ipc = CUDA_IPC_SGLANG
    adapter_folders_kept = False
    compare_digests: DigestCompare | None = None

    @property
    def adapters(self) -> Callable[[str, float], AdapterControl] | None:
        """``/load_lora_adapter`` from a folder (0.5.10 .. 0.5.23)."""
        from asyncrl.engines.rollout.sglang.client import SGLangClient

        return SGLangClient

    def engine(self, url: str, timeout_s: float) -> WeightEngine:
        from asyncrl.engines.rollout.sglang.client import SGLangClient

        return SGLangClient(url, timeout_s=timeout_s)

    def check(self, infos: list[dict[str, Any]], pause_mode: str) -> bool:
        from asyncrl.engines.rollout.sglang.control import sglang_check

        return sglang_check(infos, pause_mode)

    def announce(
        self, engine: WeightEngine, m: BucketManifest, group_name: str, flush: bool
    ) -> Coroutine[Any, Any, None]:
        from asyncrl.transports.weights.collective_wire import bucket_extra

        last = m.index == m.count - 1
        bucket = msgspec.structs.replace(
            m.announcement(group_name),
            flush_cache=last and flush,
            weight_version=str(m.version) if last and self.loads_live else None,
            load_format="flattened_bucket",
            extra={"asyncrl_bucket": bucket_extra(m)},
        )
        return engine.update_weights_from_distributed(bucket)

    def received(self, exc: EngineError) -> bool:
        """SGLang answers 400 with its JSON body also after receiving and loading a bucket
        (0.5.23 http_server.py:1488-1505): its handler ran, so the broadcast took place."""
        return exc.status == 200 or exc.answered

    def trainer_link(
        self, backend: str, address: str, port: int, world: int, device: str
    ) -> TrainerLink | None:
        return None  # torch's process group meets SGLang's ranks

    def digests(self, engine: WeightEngine) -> Awaitable[dict[str, str]]:
        """Refused: SGLang reports no per-tensor digests. The transport asks only families
        whose ``compare_digests`` is set, and SGLang's is None (it verifies by checksum)."""
        raise WeightSyncError("SGLang reports no per-tensor digests (compare_digests is None)")


def model_startup_s(model_path: str) -> float:
    """Seconds a GPU server may take to load ``model_path``: 300 s plus 20 s per GiB of its
    weight files (900 s when none are found, e.g. a hub id)."""
    folder = Path(model_path)
    files = [p for p in folder.glob("*") if p.suffix in (".safetensors", ".bin", ".pt", ".pth")]
    if not files:
        return 900.0
    return 300.0 + 20.0 * sum(p.stat().st_size for p in files) / 2**30


def package_missing(rc: RolloutConfig, pkg: str, install: str) -> None:
    """Servers the run starts on this host (no ``rollout.urls``) run from this Python: their
    package must be installed here (looked up, not imported)."""
    if not rc.urls and importlib.util.find_spec(pkg) is None:
        raise ValueError(
            f"rollout.backend={rc.backend!r} starts {pkg} servers on this host, but {pkg} is "
            f"not installed here: {install}, or give servers already running in rollout.urls"
        )


class SGLangFamily:
    """SGLang servers (``sglang serve``), spoken to over SGLang's HTTP API."""

    name = "SGLang"
    preload: tuple[str, ...] = ()
    derives_context = False  # SGLang's own derivation also reads rope scaling and more

    def client(self, rc: RolloutConfig, url: str) -> ManagedEngine:
        from asyncrl.engines.rollout.sglang.client import SGLangClient

        return SGLangClient(url, timeout_s=rc.request_timeout_s)

    def weights(self, rc: RolloutConfig, bucket_bytes: int) -> SGLangWeights:
        return SGLangWeights()

    def spec(self, rc: RolloutConfig, at: ServerSite) -> LaunchSpec:
        from asyncrl.engines.rollout.sglang.launcher import sglang_spec

        assert isinstance(rc, SGLangRolloutConfig)
        return sglang_spec(rc, at)

    def startup_timeout(self, rc: RolloutConfig, model_path: str) -> float:
        return model_startup_s(model_path)

    def lora_args(self, lc: LoraConfig, capacity: int) -> tuple[str, ...]:
        from asyncrl.engines.rollout.sglang.launcher import sglang_lora_args

        return sglang_lora_args(lc, capacity)

    def gpus(self, rc: RolloutConfig) -> int:
        assert isinstance(rc, SGLangRolloutConfig)
        return rc.tp_size

    def preflight(self, cfg: RunConfig, check_device: Callable[[str, str], None]) -> None:
        package_missing(cfg.rollout, "sglang", "pip install 'asyncrl[sglang]'")


FAMILY = SGLangFamily()
