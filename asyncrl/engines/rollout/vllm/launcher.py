"""vLLM server processes: ``vllm serve MODEL`` with the flags vLLM 0.33's RL API needs.

``vllm`` is vLLM's console script (``vllm.entrypoints.cli.main:main``, the wheel's
entry_points.txt); its RL routes (``/pause``, ``/init_weight_transfer_engine``, ...) are
mounted only with ``VLLM_SERVER_DEV_MODE=1`` (entrypoints/launchers/api_server/
routers.py:46-53, envs.py:1468), and weight transfer needs ``--weight-transfer-config``
(engine/arg_utils.py:866-905, config/weight_transfer.py:8-17). The token-in/token-out
generate route is registered only with ``--enable-scale-out`` (off by default,
entrypoints/common/cli_args.py:216); without it ``/inference/v1/generate`` answers 403
"Scale-out endpoints are disabled" (entrypoints/scale_out/factories.py:95-128). Starting,
health-waiting and stopping are the generic launcher's (:mod:`asyncrl.engines.rollout.launcher`).
"""

from __future__ import annotations

import json

from asyncrl.config import LoraConfig, VLLMRolloutConfig
from asyncrl.engines.rollout.launcher import LaunchSpec, ServerSite, stored_dtype
from asyncrl.engines.rollout.vllm.auth import MIDDLEWARE

__all__ = [
    "VLLM_CLI",
    "VLLM_ENV",
    "VLLM_LORA_ENV",
    "vllm_args",
    "vllm_dtype",
    "vllm_lora_args",
    "vllm_spec",
]

VLLM_CLI = "vllm.entrypoints.cli.main:main"
VLLM_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
VLLM_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
"""A LoRA run's: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` are mounted only
with it (entrypoints/serve/lora/api_router.py:30-32, envs.py:1204-1206)."""
_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # MaxLoRARanks, config/lora.py:27


def vllm_lora_args(lc: LoraConfig, capacity: int) -> tuple[str, ...]:
    """vLLM's LoRA flags for a run's adapters: ``--max-lora-rank`` the smallest value vLLM
    takes at or above ``lora.rank`` (config/lora.py:27-34); ``--max-loras`` = ``capacity``
    (adapters in one batch; the base model takes no slot); ``--max-cpu-loras`` = twice
    that: vLLM's unload forgets the name only (models/serving.py:234-248), so requests
    still running on an unloaded version keep it in the cache beside the held ones."""
    rank = next((r for r in _RANKS if r >= lc.rank), lc.rank)
    return (
        "--enable-lora",
        "--max-lora-rank", str(rank),
        "--max-loras", str(capacity),
        "--max-cpu-loras", str(2 * capacity),
    )  # fmt: skip


def vllm_dtype(rc: VLLMRolloutConfig, model_path: str) -> str:
    """``--dtype``: as configured; ``auto`` keeps vLLM's ``auto`` only for checkpoints stored
    in bfloat16 or float16 (a float32 one is served in bfloat16, as the trainer's)."""
    if rc.dtype != "auto":
        return rc.dtype
    return "auto" if stored_dtype(model_path) in ("bfloat16", "float16") else "bfloat16"


def vllm_args(rc: VLLMRolloutConfig, model_path: str, port: int, host: str, seed: int) -> list[str]:
    """``vllm serve`` arguments of one engine (``rc.extra_args`` last). ``--middleware``:
    the run secret on every route (:mod:`asyncrl.engines.rollout.vllm.auth`; vLLM's own
    ``--api-key``, added by :mod:`asyncrl.entrypoints.keyed`, guards ``/v1`` and
    ``/inference`` only). ``--enable-scale-out``: the generate route (module docstring)."""
    args = [model_path, "--host", host, "--port", str(port), f"--middleware={MIDDLEWARE}"]
    args += ["--enable-scale-out"]
    args += ["--dtype", vllm_dtype(rc, model_path), "--seed", str(seed)]
    args += ["--tensor-parallel-size", str(rc.tp_size)]
    args += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    if rc.gpu_memory_utilization:
        args += ["--gpu-memory-utilization", str(rc.gpu_memory_utilization)]
    return [*args, *rc.extra_args]


def vllm_spec(rc: VLLMRolloutConfig, at: ServerSite) -> LaunchSpec:
    """One vLLM server of a run at ``at``, on GPUs ``at.gpu .. at.gpu + tp_size - 1``
    (``CUDA_VISIBLE_DEVICES``), with ``VLLM_SERVER_DEV_MODE=1``; a LoRA run's flags
    ``at.lora`` (:func:`vllm_lora_args`) with :data:`VLLM_LORA_ENV`. The model path is ``vllm
    serve``'s positional argument, so the spec's own flags are not used."""
    gpus = ",".join(str(at.gpu + k) for k in range(rc.tp_size))
    args = [*vllm_args(rc, at.model_path, at.port, at.host, at.seed), *at.lora]
    return LaunchSpec(
        at.model_path,
        at.port,
        at.host,
        rc.tp_size,
        None,
        tuple(args),
        "vllm",
        env={**VLLM_ENV, **(VLLM_LORA_ENV if at.lora else {}), "CUDA_VISIBLE_DEVICES": gpus},
        entry_point=(VLLM_CLI, "serve"),
        own_flags=False,
        key_flag="--api-key",  # the run secret (asyncrl.entrypoints.keyed)
        backend="vllm",
    )
