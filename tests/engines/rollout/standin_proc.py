"""What the SGLang and vLLM test servers and receiving ranks do the same way: a stand-in
server process (its wire log, its state, waiting for it to answer) and a rank process
driven by JSON lines. Each family keeps its own wire (``sglang/``, ``vllm/``)."""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
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
    ``answer`` it later (in order). The first answer is its ready line (``ready``).

    Started as a fresh interpreter talking over its stdin and stdout; or, with ``spawn``
    (``spawn(args, log_path, env) -> process``, e.g. a fork server's), with
    ``--connect PATH`` appended, over a unix socket it connects to at ``PATH``."""

    def __init__(
        self,
        who: str,
        argv: list[str],
        env: dict[str, str],
        log: Any = None,
        start_timeout_s: float = 120.0,
        timeout_s: float = 60.0,
        spawn: Callable[[list[str], Path | None, dict[str, str]], Any] | None = None,
    ):
        self.who, self.timeout_s = who, timeout_s
        self._in: Any
        self._out: Any
        if spawn is None:
            self.proc: Any = subprocess.Popen(
                [sys.executable, "-m", *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log if log is not None else subprocess.DEVNULL,
                env=env,
                text=True,
            )
            self._in, self._out = self.proc.stdin, self.proc.stdout
        else:
            log_path = Path(log.name) if isinstance(getattr(log, "name", None), str) else None
            self._connected(argv, env, log_path, spawn, start_timeout_s)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self.answer(start_timeout_s)

    def _connected(
        self, argv: list[str], env: dict[str, str], log: Path | None, spawn: Any, timeout_s: float
    ) -> None:
        """Start the rank by ``spawn`` and wait (up to ``timeout_s``) for it to connect."""
        folder = tempfile.mkdtemp(prefix="asyncrl-rank-")
        path = os.path.join(folder, "rank.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            listener.listen(1)
            listener.settimeout(0.2)
            self.proc = spawn(["-m", *argv, "--connect", path], log, env)
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    conn, _ = listener.accept()
                    break
                except TimeoutError:
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"{self.who} (pid {self.proc.pid}) exited") from None
                    if time.monotonic() > deadline:
                        stop([self.proc])
                        raise TimeoutError(
                            f"{self.who} (pid {self.proc.pid}) did not connect in {timeout_s}s"
                        ) from None
        finally:
            listener.close()
            shutil.rmtree(folder, ignore_errors=True)
        conn.settimeout(None)
        self._in, self._out = conn.makefile("w"), conn.makefile("r")

    def _read(self) -> None:
        for line in self._out:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, op: str, **fields: Any) -> None:
        self._in.write(json.dumps({"op": op, **fields}) + "\n")
        self._in.flush()

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
        if not isinstance(self.proc, subprocess.Popen):  # forked: its own session
            stop([self.proc], 0.0)
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
