"""Drive receiving ranks built from SGLang's code (``rank.py``) in child processes."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from typing import Any

from tests.engines.rollout.sglang.code import sglang_env

__all__ = ["SGLangRank"]


class SGLangRank:
    """One ``rank.py`` process: ``send`` a command now, ``answer`` it later (in order)."""

    def __init__(self, version: str, log: Any = None, start_timeout_s: float = 120.0):
        self.version = version
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.engines.rollout.sglang.rank", "--version", version],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log if log is not None else subprocess.DEVNULL,
            env=sglang_env(version),
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.loaded_how = self.answer(start_timeout_s)["ready"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, op: str, **fields: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The next answer; raises TimeoutError / RuntimeError naming this rank."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"SGLang {self.version} rank (pid {self.proc.pid}) silent for {timeout_s}s"
            ) from None
        if line is None:
            raise RuntimeError(f"SGLang {self.version} rank exited ({self.proc.poll()})")
        return json.loads(line)

    def call(self, op: str, timeout_s: float = 60.0, **fields: Any) -> dict[str, Any]:
        self.send(op, **fields)
        return self.answer(timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
