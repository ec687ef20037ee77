"""The embedded engine's family (``asyncrl serve``): its registry entry (:data:`FAMILY`) and
its side of weight sync (:class:`LocalWeights`). It speaks SGLang's protocol, so its client
is SGLang's; it promises more (staged, checksummed, all-or-nothing buckets, CUDA IPC,
adapters over the collective transport). Imports nothing of the engine itself: the
controller loads this module to launch engines, the trainer to push weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncrl.config import LocalRolloutConfig, LoraConfig, RolloutConfig, RunConfig
from asyncrl.engines.rollout.base import AdapterControl, EngineError
from asyncrl.engines.rollout.sglang.family import SGLangFamily, SGLangWeights

if TYPE_CHECKING:
    from asyncrl.engines.rollout.launcher import LaunchSpec, ServerSite

__all__ = ["FAMILY", "LOCAL_SERVER", "LocalFamily", "LocalWeights"]

LOCAL_SERVER = "asyncrl.entrypoints.engine"
"""The embedded engine's server module (``python -m``; it accepts SGLang's flags)."""


class LocalWeights(SGLangWeights):
    """The embedded engine's side of weight sync: SGLang's load format, read further (the
    ``asyncrl_bucket`` field: chunks, checksums, deltas), staged and committed all-or-nothing
    (``/update_weight_version``), so not live: chunks of a tensor allowed, generation paused
    only as ``weights.pause_scope`` says. It answers ``success: false`` with HTTP 200 once
    it received a bucket, 4xx only before; it maps CUDA IPC hand-offs; LoRA adapters come
    over the collective transport into its in-memory ring."""

    name = "embedded engine"
    loads_live = False
    no_ipc = ""

    @property
    def adapters(self) -> Callable[[str, float], AdapterControl] | None:
        return None

    def check(self, infos: list[dict[str, object]], pause_mode: str) -> bool:
        return True  # every pause mode; the cache flushed with the last bucket

    def received(self, exc: EngineError) -> bool:
        return exc.status == 200


class LocalFamily(SGLangFamily):
    """Embedded engines started by the run (``python -m asyncrl.entrypoints.engine``)."""

    name = "embedded engine"
    preload: tuple[str, ...] = (LOCAL_SERVER,)  # the fork server imports it ahead
    derives_context = True  # the model's max_position_embeddings (local/server.py)

    def weights(self, rc: RolloutConfig, bucket_bytes: int) -> LocalWeights:
        return LocalWeights()

    def spec(self, rc: RolloutConfig, at: ServerSite) -> LaunchSpec:
        """``at.dtype`` is the trainer's; weight groups joined on loopback and at
        ``at.weight_master``; ``at.lora``: the embedded engine's LoRA flags."""
        from asyncrl.engines.rollout.launcher import LaunchSpec

        assert isinstance(rc, LocalRolloutConfig)
        extra = ["--device", rc.device, "--dtype", at.dtype, "--seed", str(at.seed)]
        extra += ["--weight-masters", f"loopback,{at.weight_master}"]
        extra += ["--max-batch-size", str(rc.max_batch_size)]
        extra += ["--kv-after-update", rc.kv_after_update, *at.lora, *rc.extra_args]
        return LaunchSpec(
            at.model_path, at.port, at.host, 1, None, (*extra,), LOCAL_SERVER, backend="local"
        )

    def startup_timeout(self, rc: RolloutConfig, model_path: str) -> float:
        return 120.0

    def lora_args(self, lc: LoraConfig, capacity: int) -> tuple[str, ...]:
        return (
            "--enable-lora",
            "--max-lora-rank", str(lc.rank),
            "--lora-alpha", repr(lc.alpha),
            "--lora-target-modules", ",".join(lc.target_modules),
            "--max-loaded-loras", str(capacity),
            "--lora-name", lc.name,
        )  # fmt: skip

    def gpus(self, rc: RolloutConfig) -> int:
        assert isinstance(rc, LocalRolloutConfig)
        return 1 if rc.device.startswith("cuda") else 0

    def preflight(self, cfg: RunConfig, check_device: Callable[[str, str], None]) -> None:
        assert isinstance(cfg.rollout, LocalRolloutConfig)
        if not cfg.rollout.urls:
            check_device("rollout.device", cfg.rollout.device)


FAMILY = LocalFamily()
