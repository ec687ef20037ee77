"""vLLM server processes: ``vllm serve MODEL`` with the flags vLLM 0.33's RL API needs.

``vllm`` is vLLM's console script (``vllm.entrypoints.cli.main:main``, the wheel's
entry_points.txt); its RL routes (``/pause``, ``/init_weight_transfer_engine``, ...) are
mounted only with ``VLLM_SERVER_DEV_MODE=1`` (entrypoints/launchers/api_server/
routers.py:46-53, envs.py:1468), and weight transfer needs ``--weight-transfer-config``
(engine/arg_utils.py:866-905, config/weight_transfer.py:8-17). Starting, health-waiting
and stopping are the generic launcher's (:mod:`asyncrl.engines.rollout.launcher`).
"""

from __future__ import annotations

import json

from asyncrl.config import VLLMRolloutConfig
from asyncrl.engines.rollout.launcher import LaunchSpec, stored_dtype

__all__ = ["VLLM_CLI", "VLLM_ENV", "vllm_args", "vllm_dtype", "vllm_spec"]

VLLM_CLI = "vllm.entrypoints.cli.main:main"
VLLM_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


def vllm_dtype(rc: VLLMRolloutConfig, model_path: str) -> str:
    """``--dtype``: as configured; ``auto`` keeps vLLM's ``auto`` only for checkpoints stored
    in bfloat16 or float16 (a float32 one is served in bfloat16, as the trainer's)."""
    if rc.dtype != "auto":
        return rc.dtype
    return "auto" if stored_dtype(model_path) in ("bfloat16", "float16") else "bfloat16"


def vllm_args(rc: VLLMRolloutConfig, model_path: str, port: int, host: str, seed: int) -> list[str]:
    """``vllm serve`` arguments of one engine (``rc.extra_args`` last)."""
    args = [model_path, "--host", host, "--port", str(port)]
    args += ["--dtype", vllm_dtype(rc, model_path), "--seed", str(seed)]
    args += ["--tensor-parallel-size", str(rc.tp_size)]
    args += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    if rc.gpu_memory_utilization:
        args += ["--gpu-memory-utilization", str(rc.gpu_memory_utilization)]
    return [*args, *rc.extra_args]


def vllm_spec(
    rc: VLLMRolloutConfig, model_path: str, port: int, host: str, base_gpu: int, seed: int
) -> LaunchSpec:
    """One vLLM server of a run on GPUs ``base_gpu .. base_gpu + tp_size - 1``
    (``CUDA_VISIBLE_DEVICES``), with ``VLLM_SERVER_DEV_MODE=1``. The model path is
    ``vllm serve``'s positional argument, so the spec's own flags are not used."""
    gpus = ",".join(str(base_gpu + k) for k in range(rc.tp_size))
    return LaunchSpec(
        model_path,
        port,
        host,
        rc.tp_size,
        None,
        tuple(vllm_args(rc, model_path, port, host, seed)),
        "vllm",
        env={**VLLM_ENV, "CUDA_VISIBLE_DEVICES": gpus},
        entry_point=(VLLM_CLI, "serve"),
        own_flags=False,
        key_flag="--api-key",  # the run secret (asyncrl.entrypoints.keyed)
    )
