"""Drive vLLM receiving ranks (``rank.py``) in child processes."""

from __future__ import annotations

from typing import Any

from asyncrl.procs import python_env
from tests.engines.rollout.standin_proc import RankProc
from tests.engines.rollout.vllm import forks
from tests.engines.rollout.vllm.code import vllm_env
from tests.engines.rollout.vllm.forks import spawn_vllm

__all__ = ["VLLMRank"]


class VLLMRank(RankProc):
    """One ``rank.py`` process (vLLM's receiving side), forked from the vLLM fork server
    where there is one (``forks.py``: vLLM's modules imported), else a fresh interpreter."""

    def __init__(self, log: Any = None, start_timeout_s: float = 120.0):
        env = python_env(vllm_env())
        argv = ["tests.engines.rollout.vllm.rank"]
        spawn = spawn_vllm if forks.SERVER.socket_path() is not None else None
        super().__init__("vLLM rank", argv, env, log, start_timeout_s, 120.0, spawn)
