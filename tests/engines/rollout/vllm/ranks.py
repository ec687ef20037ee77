"""Drive vLLM receiving ranks (``rank.py``) in child processes."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from typing import Any

from asyncrl.procs import python_env
from tests.engines.rollout.vllm.code import vllm_env

__all__ = ["VLLMRank"]


class VLLMRank:
    """One ``rank.py`` process: ``send`` a command now, ``answer`` it later (in order)."""

    def __init__(self, log: Any = None, start_timeout_s: float = 120.0):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.engines.rollout.vllm.rank"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log if log is not None else subprocess.DEVNULL,
            env=python_env(vllm_env()),
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.answer(start_timeout_s)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, op: str, **fields: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """The next answer; TimeoutError / RuntimeError naming this rank's pid."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"vLLM rank (pid {self.proc.pid}) silent for {timeout_s}s") from None
        if line is None:
            raise RuntimeError(f"vLLM rank (pid {self.proc.pid}) exited ({self.proc.poll()})")
        return json.loads(line)

    def call(self, op: str, timeout_s: float = 120.0, **fields: Any) -> dict[str, Any]:
        self.send(op, **fields)
        return self.answer(timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
