"""Start and stop the SGLang stand-in (``standin.py``) as a server process."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.engines.rollout.launcher import KEYED
from asyncrl.procs import free_port, python_env, stop
from asyncrl.secret import auth_headers
from tests.engines.rollout.sglang.code import sglang_env
from tests.runs import spawn_shared

__all__ = ["StandInServer", "start_standin"]


@dataclass
class StandInServer:
    url: str
    proc: Any
    calls: Path
    log: Path
    version: str

    def get(self, path: str, timeout_s: float = 30.0) -> Any:
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


def start_standin(
    version: str,
    model_dir: Path,
    folder: Path,
    tp_size: int = 1,
    fail_calls: str = "",
    step_s: float = 0.0,
    timeout_s: float = 120.0,
    flags: tuple[str, ...] = (),
) -> StandInServer:
    """The stand-in of SGLang ``version`` on a free loopback port, once it answers; ``flags``:
    SGLang server flags it plays (the LoRA ones, ``lora.py``)."""
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    calls, log = folder / f"calls-{port}.jsonl", folder / f"standin-{port}.log"
    # as asyncrl's SGLang launcher starts SGLang: --api-key given in memory (entrypoints/keyed.py)
    args = ["-m", KEYED, "--api-key", "--", "-m", "tests.engines.rollout.sglang.standin"]
    args += ["--sglang-version", version]
    args += ["--port", str(port), "--model-path", str(model_dir), "--tp-size", str(tp_size)]
    args += ["--calls", str(calls), "--fail-calls", fail_calls, "--step-s", str(step_s)]
    args += list(flags)
    env = python_env(sglang_env(version))
    proc = spawn_shared(args, log, env)
    server = StandInServer(f"http://127.0.0.1:{port}", proc, calls, log, version)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"SGLang {version} stand-in exited: {log.read_text()[-3000:]}")
        try:
            server.get("/model_info", timeout_s=2)
            return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                server.stop()
                raise TimeoutError(
                    f"SGLang {version} stand-in on port {port} silent for {timeout_s}s"
                ) from None
            time.sleep(0.2)
