"""Start and stop the SGLang stand-in (``standin.py``) as a server process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from asyncrl.engines.rollout.launcher import KEYED
from asyncrl.procs import free_port, python_env
from tests.engines.rollout.sglang.code import sglang_env
from tests.engines.rollout.standin_proc import StandIn, wait_answering
from tests.runs import spawn_shared

__all__ = ["StandInServer", "start_standin"]


@dataclass
class StandInServer(StandIn):
    version: str = ""


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
    who = f"SGLang {version} stand-in"
    wait_answering(server, who, lambda: server.get("/model_info", timeout_s=2), timeout_s)
    return server
