"""Drive vLLM receiving ranks (``rank.py``) in child processes."""

from __future__ import annotations

from typing import Any

from asyncrl.procs import python_env
from tests.engines.rollout.standin_proc import RankProc
from tests.engines.rollout.vllm.code import vllm_env

__all__ = ["VLLMRank"]


class VLLMRank(RankProc):
    """One ``rank.py`` process (vLLM's receiving side)."""

    def __init__(self, log: Any = None, start_timeout_s: float = 120.0):
        env = python_env(vllm_env())
        argv = ["tests.engines.rollout.vllm.rank"]
        super().__init__("vLLM rank", argv, env, log, start_timeout_s, timeout_s=120.0)
