"""A worked skeleton of a new rollout-engine family (docs/rollout-engines.md, "Adding an
engine family"): a server that speaks SGLang's HTTP API under another program, ``myserve``.

In the project this file is ``asyncrl/engines/rollout/myserve/family.py`` beside the family's
client and launcher, its config a tagged Struct in ``asyncrl/config/rollout.py`` (added to the
``RolloutConfig`` union), and the registry gets one line::

    FAMILIES = {..., MyServeRolloutConfig: "asyncrl.engines.rollout.myserve.family"}

Type-checked with the package (``mypy``) and exercised by
``tests/engines/rollout/test_family_skeleton.py``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec

from asyncrl.config import LoraConfig, RolloutConfig, RunConfig, SGLangRolloutConfig
from asyncrl.engines.rollout.base import (
    AdapterControl,
    DigestCompare,
    EngineError,
    ManagedEngine,
    TrainerLink,
    WeightAdapter,
    WeightEngine,
)
from asyncrl.engines.rollout.factory import EngineFamily
from asyncrl.engines.rollout.launcher import LaunchSpec, ServerSite
from asyncrl.transports.weights.bucket import BucketManifest

MyServeRolloutConfig = SGLangRolloutConfig  # in the project: its own tagged config Struct


class MyServeWeights:
    """The family's side of weight sync: its load format, flush rule, error classes."""

    name = "myserve"
    loads_live = True  # buckets land in the live model: whole tensors, re-push on failure
    no_ipc = "weights.backend='cuda-ipc' does not reach myserve engines: use 'nccl'"
    adapters: Callable[[str, float], AdapterControl] | None = None  # no LoRA from folders
    adapter_folders_kept = False
    compare_digests: DigestCompare | None = None  # it reports no digests

    def engine(self, url: str, timeout_s: float) -> WeightEngine:
        from asyncrl.engines.rollout.sglang.client import SGLangClient

        return SGLangClient(url, timeout_s=timeout_s)  # it speaks SGLang's routes

    def check(self, infos: list[dict[str, Any]], pause_mode: str) -> bool:
        if pause_mode != "abort":
            raise ValueError(f"rollout.pause_mode={pause_mode!r}: myserve takes 'abort' only")
        return True  # flush the cache with the last bucket

    def announce(
        self, engine: WeightEngine, m: BucketManifest, group_name: str, flush: bool
    ) -> Coroutine[Any, Any, None]:
        last = m.index == m.count - 1
        bucket = msgspec.structs.replace(
            m.announcement(group_name),
            flush_cache=last and flush,
            weight_version=str(m.version) if last else None,
            load_format="flattened_bucket",
        )
        return engine.update_weights_from_distributed(bucket)

    def received(self, exc: EngineError) -> bool:
        return exc.status == 200  # an error answer: it did not take part in the broadcast

    def trainer_link(
        self, backend: str, address: str, port: int, world: int, device: str
    ) -> TrainerLink | None:
        return None  # its ranks join torch's process group

    def digests(self, engine: WeightEngine) -> Awaitable[dict[str, str]]:
        raise NotImplementedError("myserve reports no digests (compare_digests is None)")


class MyServeFamily:
    """What a run needs to launch and reach myserve engines."""

    name = "myserve"
    preload: tuple[str, ...] = ()  # a program of its own: nothing for the fork server
    derives_context = False

    def client(self, rc: RolloutConfig, url: str) -> ManagedEngine:
        from asyncrl.engines.rollout.sglang.client import SGLangClient

        return SGLangClient(url, timeout_s=rc.request_timeout_s)

    def weights(self, rc: RolloutConfig, bucket_bytes: int) -> WeightAdapter:
        return MyServeWeights()

    def spec(self, rc: RolloutConfig, at: ServerSite) -> LaunchSpec:
        extra = ("--random-seed", str(at.seed), "--base-gpu-id", str(at.gpu), *at.lora)
        extra += rc.extra_args
        return LaunchSpec(at.model_path, at.port, at.host, 1, None, extra, "myserve.launch_server")

    def startup_timeout(self, rc: RolloutConfig, model_path: str) -> float:
        return 600.0

    def lora_args(self, lc: LoraConfig, capacity: int) -> tuple[str, ...]:
        raise ValueError("lora.enabled: myserve serves no adapters")

    def gpus(self, rc: RolloutConfig) -> int:
        return 1

    def preflight(self, cfg: RunConfig, check_device: Callable[[str, str], None]) -> None:
        if cfg.rollout.num_engines > 8:
            raise ValueError("rollout.num_engines: myserve runs at most 8 engines per host")


FAMILY: EngineFamily = MyServeFamily()
