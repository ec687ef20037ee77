"""Drive receiving ranks built from SGLang's code (``rank.py``) in child processes."""

from __future__ import annotations

from typing import Any

from tests.engines.rollout.sglang import forks
from tests.engines.rollout.sglang.code import sglang_env
from tests.engines.rollout.standin_proc import RankProc

__all__ = ["SGLangRank"]


class SGLangRank(RankProc):
    """One ``rank.py`` process of SGLang ``version``, forked from that version's session fork
    server where there is one (``forks.py``), else a fresh interpreter; ``loaded_how``: its
    ready line."""

    def __init__(self, version: str, log: Any = None, start_timeout_s: float = 120.0):
        self.version = version
        argv = ["tests.engines.rollout.sglang.rank", "--version", version]
        fork = forks.server(version)
        spawn = fork.spawn if fork.socket_path() is not None else None
        env, who = sglang_env(version), f"SGLang {version} rank"
        super().__init__(who, argv, env, log, start_timeout_s, spawn=spawn)
        self.loaded_how = self.ready["ready"]
