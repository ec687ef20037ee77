"""Drive receiving ranks built from SGLang's code (``rank.py``) in child processes."""

from __future__ import annotations

from typing import Any

from tests.engines.rollout.sglang.code import sglang_env
from tests.engines.rollout.standin_proc import RankProc

__all__ = ["SGLangRank"]


class SGLangRank(RankProc):
    """One ``rank.py`` process of SGLang ``version``; ``loaded_how``: its ready line."""

    def __init__(self, version: str, log: Any = None, start_timeout_s: float = 120.0):
        self.version = version
        argv = ["tests.engines.rollout.sglang.rank", "--version", version]
        super().__init__(f"SGLang {version} rank", argv, sglang_env(version), log, start_timeout_s)
        self.loaded_how = self.ready["ready"]
