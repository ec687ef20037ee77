"""The one place an engine family is chosen: the family registry, by tagged ``RolloutConfig``.

Each family lives in its own folder (``engines/rollout/{local,sglang,vllm}/``) with its
client, launcher and ``family.py``, whose ``FAMILY`` is an :class:`EngineFamily`: what the
controller needs to launch and reach its engines (launch arguments, start-up timeout,
LoRA flags, preflight rules, GPUs) and, through :meth:`EngineFamily.weights`, what the
weight transport needs (a :class:`~asyncrl.transports.weights.seam.WeightAdapter`).
:data:`FAMILIES` holds one line per family, naming the module (imported on first use, so
a process loads only the family it runs). No other code compares backend names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec

from asyncrl.config import (
    LocalRolloutConfig,
    LoraConfig,
    RolloutConfig,
    RunConfig,
    SGLangRolloutConfig,
    VLLMRolloutConfig,
    WeightSyncConfig,
)
from asyncrl.engines.rollout.base import ManagedEngine, WeightAdapter

if TYPE_CHECKING:
    from asyncrl.engines.rollout.launcher import LaunchSpec, ServerSite
    from asyncrl.transports.weights.adapter_send import AdapterSpec
    from asyncrl.transports.weights.base import WeightTransport

__all__ = [
    "FAMILIES",
    "EngineFamily",
    "family",
    "make_engine",
    "make_weight_transport",
    "rollout_config",
    "weight_family",
]

FAMILIES: dict[type[RolloutConfig], str] = {
    LocalRolloutConfig: "asyncrl.engines.rollout.local.family",
    SGLangRolloutConfig: "asyncrl.engines.rollout.sglang.family",
    VLLMRolloutConfig: "asyncrl.engines.rollout.vllm.family",
}
"""Config type -> the module whose ``FAMILY`` serves it (one line per family)."""


class EngineFamily(Protocol):
    """One engine family, as a run uses it (``{family}/family.py``'s ``FAMILY``).

    Contract: ``name`` names the family in messages; ``preload`` are the modules the run's
    fork server imports ahead for its servers; ``derives_context``: the engines' context
    length is the model's ``max_position_embeddings`` (checked before the run starts).
    :meth:`client` is the controller's client of the engine at ``url``; :meth:`weights`
    the family's side of weight sync (``bucket_bytes``: the transport's bucket size);
    :meth:`spec` the family's server at ``at`` (a ``launcher.ServerSite``: port, host,
    first GPU, seed, the trainer's dtype, the weight group's host, :meth:`lora_args`);
    :meth:`startup_timeout` how long its servers may take to answer when
    ``rollout.startup_timeout_s`` is unset; :meth:`lora_args` the servers' flags for
    ``capacity`` adapter versions; :meth:`gpus` the GPUs one engine takes;
    :meth:`preflight` raises ValueError (one line, naming the key) for what this host cannot
    start (``check_device(key, device)`` checks a device string).
    """

    name: str
    preload: tuple[str, ...]
    derives_context: bool

    def client(self, rc: RolloutConfig, url: str) -> ManagedEngine: ...

    def weights(self, rc: RolloutConfig, bucket_bytes: int) -> WeightAdapter: ...

    def spec(self, rc: RolloutConfig, at: ServerSite) -> LaunchSpec: ...

    def startup_timeout(self, rc: RolloutConfig, model_path: str) -> float: ...

    def lora_args(self, lc: LoraConfig, capacity: int) -> tuple[str, ...]: ...

    def gpus(self, rc: RolloutConfig) -> int: ...

    def preflight(self, cfg: RunConfig, check_device: Callable[[str, str], None]) -> None: ...


def rollout_config(rollout: RolloutConfig | str) -> RolloutConfig:
    """``rollout`` itself, or the default config of the backend tag ``rollout`` names."""
    if isinstance(rollout, str):
        return msgspec.convert({"backend": rollout}, RolloutConfig)
    return rollout


def family(rollout: RolloutConfig | str) -> EngineFamily:
    """The family serving ``rollout`` (a config or a backend tag)."""
    module = importlib.import_module(FAMILIES[type(rollout_config(rollout))])
    found: EngineFamily = module.FAMILY
    return found


def make_engine(rollout: RolloutConfig, url: str) -> ManagedEngine:
    """The client of the engine at ``url`` with the run's request timeout."""
    return family(rollout).client(rollout, url)


def weight_family(rollout: RolloutConfig | str, bucket_bytes: int = 1 << 30) -> WeightAdapter:
    """What the weight transport needs of ``rollout``'s engine family (``bucket_bytes``: the
    transport's bucket size, which vLLM's packed chunks are cut at)."""
    rc = rollout_config(rollout)
    return family(rc).weights(rc, bucket_bytes)


def make_weight_transport(
    cfg: WeightSyncConfig,
    engine_urls: Sequence[str],
    device: str,
    pause_mode: str = "abort",
    engine: RolloutConfig | str = "local",
    adapters: AdapterSpec | None = None,
) -> WeightTransport:
    """The weight transport of ``cfg`` into engines of ``engine``'s family (a config or a
    backend tag): the family's :class:`~asyncrl.transports.weights.seam.WeightAdapter`
    handed to the transports' factory (:func:`asyncrl.transports.weights.make_sender`,
    which chooses the backend). ``adapters``: a LoRA run's adapters."""
    from asyncrl.transports.weights import make_sender

    bucket_bytes = getattr(cfg, "bucket_mb", 1024) << 20
    return make_sender(
        cfg, engine_urls, device, weight_family(engine, bucket_bytes), pause_mode, adapters
    )
