"""What the SGLang and vLLM test servers and receiving ranks do the same way: a stand-in
server process (its wire log, its state, waiting for it to answer) and a rank process
driven by JSON lines. Each family keeps its own wire (``sglang/``, ``vllm/``)."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.procs import stop
from asyncrl.secret import auth_headers

__all__ = ["RankProc", "StandIn", "wait_answering"]


@dataclass
class StandIn:
    """A stand-in server process on loopback: ``calls`` is its wire log (JSON lines)."""

    url: str
    proc: Any
    calls: Path
    log: Path

    def get(self, path: str, timeout_s: float = 60.0) -> Any:
        req = urllib.request.Request(self.url + path, headers=auth_headers())
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())

    def state(self) -> dict[str, Any]:
        return self.get("/standin/state")

    def wire(self) -> list[dict[str, Any]]:
        """Every request the stand-in served, in order (method, path, status, small body)."""
        return [json.loads(x) for x in self.calls.read_text().splitlines()]

    def stop(self) -> None:
        stop([self.proc])


def wait_answering(
    server: StandIn, who: str, probe: Callable[[], object], timeout_s: float
) -> None:
    """Poll ``probe`` until it answers; raises RuntimeError naming ``who`` if the process
    exits (with its log's tail) or answers with an HTTP error, TimeoutError after
    ``timeout_s``; the server is stopped on either."""
    deadline = time.monotonic() + timeout_s
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{who} exited: {server.log.read_text()[-3000:]}")
        try:
            probe()
            return
        except urllib.error.HTTPError as exc:  # it answered, and not 200: no use waiting
            server.stop()
            raise RuntimeError(f"{who} answered HTTP {exc.code}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                server.stop()
                raise TimeoutError(f"{who} at {server.url} silent for {timeout_s}s") from None
            time.sleep(0.2)


class RankProc:
    """One rank process (``python -m module``) speaking JSON lines: ``send`` a command now,
    ``answer`` it later (in order). The first answer is its ready line (``ready``)."""

    def __init__(
        self,
        who: str,
        argv: list[str],
        env: dict[str, str],
        log: Any = None,
        start_timeout_s: float = 120.0,
        timeout_s: float = 60.0,
    ):
        self.who, self.timeout_s = who, timeout_s
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log if log is not None else subprocess.DEVNULL,
            env=env,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self.answer(start_timeout_s)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, op: str, **fields: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The next answer; raises TimeoutError / RuntimeError naming this rank and its pid."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"{self.who} (pid {self.proc.pid}) silent for {timeout_s}s"
            ) from None
        if line is None:
            raise RuntimeError(f"{self.who} (pid {self.proc.pid}) exited ({self.proc.poll()})")
        return json.loads(line)

    def call(self, op: str, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        self.send(op, **fields)
        return self.answer(timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
