"""vLLM 0.33.0's own source for the tests (unpacked by ``scripts/setup.sh`` under
``.cache/vllm/0.33.0``, Python files only, not installed).

What of it runs on this CPU machine with the test extra's light dependencies:

- imports: ``vllm.distributed.utils`` (``StatelessProcessGroup``, the rendezvous vLLM's
  workers and trainer use: a TCP store hosted by rank 0) — the stand-in's receiving ranks
  join the weight group with it; ``vllm/distributed/weight_transfer/packed_tensor.py``
  loaded from its file (it imports only torch; its package ``__init__`` pulls
  ``vllm.config``, which needs ``cbor2`` and more) — its ``pack_tensors`` and
  ``unpack_tensor`` run on CPU tensors.
- does not import here: ``vllm.distributed.weight_transfer`` (package), ``nccl_engine``,
  ``nccl_common``, ``clients``, ``base`` (``vllm.config`` -> ``cbor2``, then CUDA-only
  modules), ``vllm.outputs``, ``vllm.v1.worker.gpu_worker``,
  ``vllm.entrypoints.rl.online.api_router`` (FastAPI and the engine); and
  ``packed_nccl_broadcast_*`` need CUDA streams and PyNccl: NCCL cannot run on a CPU.
  Those parts are played by the stand-in (``standin.py``), written from that source.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

VERSION = "0.33.0"
ROOT = Path(__file__).resolve().parents[4]
DEPS = ROOT / ".cache" / "vllm-deps" / VERSION
"""vLLM's API-server dependencies (FastAPI, ...) at the versions its METADATA requires,
installed by ``scripts/setup.sh`` beside the test environment, not into it: on the path of
the vLLM server process only (``vllm_env``)."""


def missing(why: str) -> None:
    """A test that needs upstream code which is absent: skips locally, naming why; FAILS
    under CI (``CI=true``, as ``.ci/run`` runs): upstream code never skips silently there."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI: {why}", pytrace=False)
    pytest.skip(why)


def vllm_src() -> Path:
    """The unpacked source; the calling test skips (fails under CI), naming the set-up
    step, when absent."""
    src = ROOT / ".cache" / "vllm" / VERSION
    if not (src / "vllm" / "distributed" / "utils.py").is_file():
        missing(f"vLLM {VERSION}'s source is not under {src}: run scripts/setup.sh")
    return src


def vllm_deps() -> Path:
    """vLLM's server dependencies (``DEPS``); skips (fails under CI) when absent."""
    if not (DEPS / "fastapi").is_dir():
        missing(f"vLLM {VERSION}'s server dependencies are not under {DEPS}: run scripts/setup.sh")
    return DEPS


def vllm_env() -> dict[str, str]:
    """Environment of a process that imports vLLM's modules from the unpacked source, with
    its server dependencies (``DEPS``) ahead of the test environment's packages."""
    src = str(ROOT / ".cache" / "vllm" / VERSION)
    parts = (src, str(DEPS), str(ROOT), os.environ.get("PYTHONPATH", ""))
    path = os.pathsep.join(p for p in parts if p)
    # VLLM_TARGET_DEVICE: vLLM's own CPU platform in place of CUDA's (platforms/__init__.py:
    # 174-177); without a platform vLLM's parser cannot build its defaults (device.py:55)
    return {"PYTHONPATH": path, "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1",
            "VLLM_TARGET_DEVICE": "cpu"}  # fmt: skip


def load_file(relative: str, name: str) -> ModuleType:
    """A vLLM module loaded from its file alone (its package ``__init__`` not run)."""
    path = vllm_src() / relative
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def packed_tensor() -> ModuleType:
    """vLLM's ``vllm/distributed/weight_transfer/packed_tensor.py``."""
    return load_file("vllm/distributed/weight_transfer/packed_tensor.py", "vllm_packed_tensor")
