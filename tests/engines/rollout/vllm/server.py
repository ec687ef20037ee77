"""Start and stop the vLLM test server (``app.py``: vLLM 0.33's own API server code over the
stand-in's engine core, ``standin.py``) as a server process, started with the very argv
asyncrl's launcher gives ``vllm serve``."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from asyncrl.config import VLLMRolloutConfig
from asyncrl.engines.rollout.launcher import KEYED
from asyncrl.engines.rollout.vllm.launcher import VLLM_ENV, vllm_args
from asyncrl.procs import finish, free_port
from asyncrl.secret import auth_headers
from tests.engines.rollout.standin_proc import StandIn, wait_answering
from tests.engines.rollout.vllm.app import ENV
from tests.engines.rollout.vllm.code import vllm_deps, vllm_env, vllm_src
from tests.engines.rollout.vllm.forks import spawn_vllm

__all__ = ["VLLMStandIn", "start_vllm"]

OWN_FLAGS = ("--no-truth",)
"""Flags of ``start_vllm`` that are the stand-in's own (``standin.arg_parser``); every other
one is a ``vllm serve`` flag, parsed by vLLM's parser."""


class VLLMStandIn(StandIn):
    """vLLM's API server over the stand-in's engine core; its wire log has the query too."""


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
    drop: tuple[str, ...] = (),
) -> VLLMStandIn:
    """vLLM 0.33's API server (``app.py``) on a free loopback port, once its ``/health``
    answers, started with ``vllm_args`` (asyncrl's launcher: ``tp_size``) + ``flags`` (more
    ``vllm serve`` flags, e.g. LoRA's; ``--no-truth`` is the stand-in's own) and the
    launcher's environment (``VLLM_SERVER_DEV_MODE=1``) + ``env``; ``guard``: with the
    launcher's ``--middleware`` (the run secret on every route); False: vLLM's
    ``--api-key`` alone; ``drop``: flags of the launcher's left out (a server started by
    hand without them)."""
    vllm_src()
    vllm_deps()
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    calls, log = folder / f"calls-{port}.jsonl", folder / f"standin-{port}.log"
    rc = VLLMRolloutConfig(tp_size=tp_size)
    served = [a for a in flags if a not in OWN_FLAGS]
    argv = [*vllm_args(rc, str(model_dir), port, "127.0.0.1", 0), *served]
    argv = [a for a in argv if a not in drop]
    if not guard:  # vLLM's --api-key alone
        argv = [a for a in argv if not a.startswith("--middleware")]
    # as asyncrl's vLLM launcher starts vLLM: --api-key given in memory (entrypoints/keyed.py)
    args = ["-m", KEYED, "--api-key", "--", "-m", "tests.engines.rollout.vllm.app", *argv]
    own = ["--calls", str(calls), "--fail-calls", fail_calls, "--corrupt-calls", corrupt_calls]
    own += ["--step-s", str(step_s), "--log", str(log), *(a for a in flags if a in OWN_FLAGS)]
    env = {**vllm_env(), **VLLM_ENV, **(env or {}), ENV: json.dumps(own)}
    proc = spawn_vllm(args, log, env)
    server = VLLMStandIn(f"http://127.0.0.1:{port}", proc, calls, log)

    def health() -> None:
        req = urllib.request.Request(server.url + "/health", headers=auth_headers())
        urllib.request.urlopen(req, timeout=2).close()

    wait_answering(server, "vLLM stand-in", health, timeout_s)
    return server


def vllm_parse(*argvs: list[str]) -> list[dict[str, Any] | str]:
    """Each argv parsed by vLLM 0.33's own ``vllm serve`` parser (``app.parse_vllm_argv``),
    in one process with vLLM's server dependencies on its path (``parse.py``, forked from
    the vLLM fork server where there is one): a few parsed values, or the parser's error
    message (it exits 2, as ``vllm serve`` does)."""
    import tempfile

    vllm_src()
    vllm_deps()
    with tempfile.TemporaryDirectory(prefix="asyncrl-vllm-parse-") as tmp:
        out, log = Path(tmp) / "out.json", Path(tmp) / "log"
        args = ["-m", "tests.engines.rollout.vllm.parse", json.dumps(list(argvs)), str(out)]
        code, _ = finish(spawn_vllm(args, log, vllm_env()), 120.0)
        if code or not out.is_file():
            raise RuntimeError(
                f"vLLM's parser could not run (rc {code}): {log.read_text()[-2000:]}"
            )
        return list(json.loads(out.read_text()))
