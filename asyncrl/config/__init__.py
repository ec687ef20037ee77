"""Run configuration: frozen msgspec Structs, TOML files and dotted CLI overrides.

Every field has a default, so ``RunConfig()`` is the embedded default job. A TOML
file sets any subset of the sections below; ``--section.key=value`` overrides win
over the file. Validation errors are ``ValueError`` naming the dotted key and,
for choices, the allowed values. This package never imports torch.

Three sections are one type per choice (msgspec tagged unions): ``weights`` and ``rollout``
by ``backend`` (:class:`CollectiveWeightsConfig` for ``auto`` / ``gloo`` / ``nccl`` /
``hccl``, :class:`CudaIpcWeightsConfig` for ``cuda-ipc``; :class:`LocalRolloutConfig`,
:class:`SGLangRolloutConfig`, :class:`VLLMRolloutConfig`) and ``task`` by ``name``
(:class:`ReverseTaskConfig`, :class:`MathTaskConfig`, :class:`AgentTaskConfig`,
:class:`LongTailTaskConfig`, :class:`AgenticTaskConfig`). An option of another backend (or
task) is refused, naming the one(s) it belongs to; omitting the tag keeps the default one.
Numeric limits are declared on the fields (``Annotated[int, msgspec.Meta(gt=0)]``), checked
when a config is decoded and when a section is built in Python; non-finite floats are
refused everywhere.
"""

from __future__ import annotations

from asyncrl.config.evaluation import EvalConfig
from asyncrl.config.gateway import GatewayConfig
from asyncrl.config.load import load_config, to_dict
from asyncrl.config.lora import LoraConfig
from asyncrl.config.rollout import (
    DEFAULT_MAX_NEW_TOKENS,
    PAUSE_MODES,
    VLLM_PAUSE_MODES,
    LocalRolloutConfig,
    PauseMode,
    RolloutConfig,
    SGLangRolloutConfig,
    VLLMRolloutConfig,
)
from asyncrl.config.run import (
    CheckpointConfig,
    ClusterConfig,
    ControllerConfig,
    ExperienceConfig,
    LoggingConfig,
    ModelConfig,
    RunConfig,
    TensorBoardConfig,
    TraceConfig,
    WandbConfig,
)
from asyncrl.config.task import (
    AgenticConfig,
    AgenticTaskConfig,
    AgentTaskConfig,
    LongTailConfig,
    LongTailTaskConfig,
    MathTaskConfig,
    ReverseTaskConfig,
    TaskConfig,
)
from asyncrl.config.trainer import AlgoConfig, TrainerConfig
from asyncrl.config.weights import (
    AutoWeightsConfig,
    CollectiveWeightsConfig,
    CudaIpcWeightsConfig,
    GlooWeightsConfig,
    HcclWeightsConfig,
    NcclWeightsConfig,
    WeightSyncConfig,
)

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "PAUSE_MODES",
    "VLLM_PAUSE_MODES",
    "AgentTaskConfig",
    "AgenticConfig",
    "AgenticTaskConfig",
    "AlgoConfig",
    "AutoWeightsConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "CollectiveWeightsConfig",
    "ControllerConfig",
    "CudaIpcWeightsConfig",
    "EvalConfig",
    "ExperienceConfig",
    "GatewayConfig",
    "GlooWeightsConfig",
    "HcclWeightsConfig",
    "LocalRolloutConfig",
    "LoggingConfig",
    "LongTailConfig",
    "LongTailTaskConfig",
    "LoraConfig",
    "MathTaskConfig",
    "ModelConfig",
    "NcclWeightsConfig",
    "PauseMode",
    "ReverseTaskConfig",
    "RolloutConfig",
    "RunConfig",
    "SGLangRolloutConfig",
    "TaskConfig",
    "TensorBoardConfig",
    "TraceConfig",
    "TrainerConfig",
    "VLLMRolloutConfig",
    "WandbConfig",
    "WeightSyncConfig",
    "load_config",
    "to_dict",
]
