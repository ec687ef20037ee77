"""Start and stop the vLLM stand-in (``standin.py``) as a server process."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config import VLLMRolloutConfig
from asyncrl.engines.rollout.launcher import KEYED
from asyncrl.engines.rollout.vllm.launcher import vllm_args
from asyncrl.procs import free_port, python_env, stop
from asyncrl.secret import auth_headers
from tests.engines.rollout.vllm.code import vllm_env, vllm_src
from tests.runs import spawn_shared

__all__ = ["VLLMStandIn", "start_vllm"]


@dataclass
class VLLMStandIn:
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
        """Every request the stand-in served, in order (method, path, query, status, body)."""
        return [json.loads(x) for x in self.calls.read_text().splitlines()]

    def stop(self) -> None:
        stop([self.proc])


def start_vllm(
    model_dir: Path,
    folder: Path,
    tp_size: int = 1,
    fail_calls: str = "",
    corrupt_calls: str = "",
    step_s: float = 0.0,
    timeout_s: float = 120.0,
    flags: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    guard: bool = True,
) -> VLLMStandIn:
    """The vLLM 0.33 stand-in on a free loopback port, once its ``/health`` answers;
    ``flags`` / ``env``: vLLM server flags and environment it plays (LoRA: ``lora.py``);
    ``guard``: with the ``--middleware`` flag of asyncrl's launcher (the run secret on every
    route); False: vLLM's ``--api-key`` alone."""
    vllm_src()
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    calls, log = folder / f"calls-{port}.jsonl", folder / f"standin-{port}.log"
    # as asyncrl's vLLM launcher starts vLLM: --api-key given in memory (entrypoints/keyed.py)
    args = ["-m", KEYED, "--api-key", "--", "-m", "tests.engines.rollout.vllm.standin"]
    args += ["--port", str(port)]
    args += ["--model-path", str(model_dir), "--tp-size", str(tp_size), "--calls", str(calls)]
    args += ["--fail-calls", fail_calls, "--corrupt-calls", corrupt_calls]
    args += ["--step-s", str(step_s), "--log", str(log), *flags]
    if guard:  # the launcher's own flag, taken from the arguments it gives vLLM
        launched = vllm_args(VLLMRolloutConfig(), str(model_dir), port, "127.0.0.1", 0)
        args += [a for a in launched if a.startswith("--middleware")]
    proc = spawn_shared(args, log, python_env({**vllm_env(), **(env or {})}))
    server = VLLMStandIn(f"http://127.0.0.1:{port}", proc, calls, log)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM stand-in exited: {log.read_text()[-3000:]}")
        try:
            req = urllib.request.Request(server.url + "/health", headers=auth_headers())
            urllib.request.urlopen(req, timeout=2).close()
            return server
        except urllib.error.HTTPError as exc:  # it answered, and not 200: no use waiting
            server.stop()
            raise RuntimeError(f"vLLM stand-in's /health: HTTP {exc.code}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                server.stop()
                raise TimeoutError(
                    f"vLLM stand-in on port {port} silent for {timeout_s}s"
                ) from None
            time.sleep(0.2)
