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
from asyncrl.procs import free_port, python_env
from asyncrl.secret import auth_headers
from tests.engines.rollout.standin_proc import StandIn, wait_answering
from tests.engines.rollout.vllm.app import ENV
from tests.engines.rollout.vllm.code import vllm_deps, vllm_env, vllm_src
from tests.runs import spawn_shared

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
    proc = spawn_shared(args, log, python_env(env))
    server = VLLMStandIn(f"http://127.0.0.1:{port}", proc, calls, log)

    def health() -> None:
        req = urllib.request.Request(server.url + "/health", headers=auth_headers())
        urllib.request.urlopen(req, timeout=2).close()

    wait_answering(server, "vLLM stand-in", health, timeout_s)
    return server


def vllm_parse(*argvs: list[str]) -> list[dict[str, Any] | str]:
    """Each argv parsed by vLLM 0.33's own ``vllm serve`` parser (``app.parse_vllm_argv``),
    in one process with vLLM's server dependencies on its path: a few parsed values, or the
    parser's error message (it exits 2, as ``vllm serve`` does)."""
    import subprocess
    import sys

    vllm_src()
    vllm_deps()
    code = """
import contextlib, io, json, sys
from tests.engines.rollout.vllm.app import parse_vllm_argv
keys = ('model', 'api_key', 'middleware', 'enable_scale_out', 'tensor_parallel_size',
        'dtype', 'port', 'host')
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            a = parse_vllm_argv(argv)
        out.append({k: getattr(a, k) for k in keys})
    except SystemExit:
        out.append(err.getvalue().strip().splitlines()[-1])
print(json.dumps(out))
"""
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(list(argvs))],
        env=python_env(vllm_env()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode:
        raise RuntimeError(f"vLLM's parser could not run: {done.stderr[-2000:]}")
    return list(json.loads(done.stdout.strip().splitlines()[-1]))
